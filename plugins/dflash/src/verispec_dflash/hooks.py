"""Entry point of verispec-dflash: the `dflash` drafter file and the `dflash` speculator (no torch here).

`--spec-type block` (a --spec-type word, so not a speculator name) picks the speculator among those
drafting with a BLOCK head; `auto` picks it when --draft-model names a `dflash` file.

`SPEC` is the one place the speculator's declarations live; `BlockSpeculator` reads them from it.
"""
from verispec.hookspecs import hookimpl
from verispec.specs import DraftFileSpec, SpeculatorSpec

#: GGUF general.architecture of both generations (llama.cpp mainline writes `dflash` for DFlash and DFlash2).
ARCHITECTURES = ("dflash",)

SPEC = SpeculatorSpec(
    name="dflash",
    summary="drafts a whole block from a BLOCK draft head (DFlash/DFlash2, --draft-model drafter.gguf) in one "
            "forward; gate: cumulative prefix confidence",
    factory="verispec_dflash.speculator:create",
    requires_draft_head=True,
    # after prefix reuse the head has no taps for the reused rows (the loop passes none): its ring
    # refills from the next committed rows, so drafts are weaker for a while, never wrong
    can_arm_after_prefix_reuse=True,
    needs_hidden_state=True,
    default_min_draft_prob=0.35,
    # above draft-model (25): a block drafter passed with --draft-model is meant to draft
    priority=30,
)


@hookimpl
def register_speculators(register):
    register(SPEC)


@hookimpl
def register_draft_files(register):
    register(DraftFileSpec(
        name="dflash",
        summary="DFlash / DFlash2 block drafter GGUF (llama.cpp mainline schema), bound to its target like a LoRA",
        architectures=ARCHITECTURES,
        loader="verispec_dflash.loader:load",
    ))
