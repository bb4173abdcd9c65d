"""Entry point of verispec-dflash: the `dflash` drafter file, the `dflash` speculator, and the drafter
this package ships for SmolLM2-135M-Instruct as a checkpoint alias (no torch here).

`--spec-type block` (a --spec-type word, so not a speculator name) picks the speculator among those
drafting with a BLOCK head; `auto` picks it when --draft-model names a `dflash` file.

`SPEC` is the one place the speculator's declarations live; `BlockSpeculator` reads them from it.
"""
from verispec.hookspecs import hookimpl, registers
from verispec.specs import CheckpointSpec, DraftFileSpec, SpeculatorSpec

#: the trained drafter shipped as package data (scripts/train_drafter.py writes it): alias, file, sha256, bytes.
BUNDLED_DRAFTER = ("dflash-smollm2-135m-instruct", "verispec_dflash/drafters/dflash-smollm2-135m-instruct.gguf",
                   "d1955455543d0e9d80c07217511a168af892a808edc5ff49151c217a4aa98546", 6597120)

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

DRAFT_FILE = DraftFileSpec(
    name="dflash",
    summary="DFlash / DFlash2 block drafter GGUF (llama.cpp mainline schema), bound to its target like a LoRA",
    architectures=ARCHITECTURES,
    loader="verispec_dflash.loader:load",
)

register_speculators = registers(SPEC)
register_draft_files = registers(DRAFT_FILE)


@hookimpl
def register_checkpoints(register):
    alias, rel, sha256, size = BUNDLED_DRAFTER
    register(CheckpointSpec(
        alias=alias,
        summary="DFlash1 drafter for smollm2-135m-instruct (1 layer, Q8_0), trained by scripts/train_drafter.py; "
                "use as --draft-model",
        pip_install="verispec-dflash",
        files=[("verispec-dflash", rel)],
        sha256=sha256,
        size_bytes=size,
    ))
