"""Entry point of verispec-eagle3: the `eagle3` drafter file and the `eagle3` speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `Eagle3Speculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import DraftFileSpec, SpeculatorSpec

#: GGUF general.architecture of an EAGLE-3 head (llama.cpp's `LLM_ARCH_EAGLE3`).
ARCHITECTURES = ("eagle3",)

SPEC = SpeculatorSpec(
    name="eagle3",
    summary="an EAGLE-3 head (--draft-model head.gguf) drafts one token per step from three trunk taps, then "
            "from its own pre-norm rows; gate: top-1 prob over its top-10 logits",
    factory="verispec_eagle3.speculator:create",
    requires_draft_head=True,
    # after prefix reuse the reused positions reach the head without taps: their rows stay missing
    # from its KV (weaker drafts for a while, never wrong ones); it drafts from the next committed rows
    can_arm_after_prefix_reuse=True,
    needs_hidden_state=True,
    # mtp's gate and default (draft_gate.top1_gate_prob); not measured on a trained EAGLE-3 head yet
    default_min_draft_prob=0.15,
    # 22: above mtp (20), which takes any PER_TOKEN head and would chain this one without knowing it
    # (its generic chain works, see head.Eagle3Head.draft_step, but `auto` should name eagle3) and
    # above gemma4-assistant (21) for the same rank order of per-token heads; below draft-model (25) and
    # dflash (30), which take other drafter kinds (MODEL, BLOCK), so the order with them never decides
    priority=22,
)

DRAFT_FILE = DraftFileSpec(
    name="eagle3",
    summary="EAGLE-3 head GGUF (llama.cpp's eagle3: fc over three trunk taps, one decoder layer, d2t draft "
            "vocabulary), bound to its target like a LoRA",
    architectures=ARCHITECTURES,
    loader="verispec_eagle3.loader:load",
)

register_speculators = registers(SPEC)
register_draft_files = registers(DRAFT_FILE)
