"""Entry point of verispec-gemma4-assistant: the assistant drafter file and its speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `AssistantSpeculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import DraftFileSpec, SpeculatorSpec

#: GGUF general.architecture values: llama.cpp's spelling first, then the forks'.
ARCHITECTURES = ("gemma4-assistant", "gemma4_assistant", "gemma4_mtp")

SPEC = SpeculatorSpec(
    name="gemma4-assistant",
    summary="a Gemma 4 assistant (--draft-model assistant.gguf) drafts k tokens at one position over the trunk's "
            "own KV; gate: top-1 prob over its top-10 logits",
    factory="verispec_gemma4_assistant.speculator:create",
    requires_draft_head=True,
    # the head holds nothing the trunk does not: it drafts over a reused prefix at once
    can_arm_after_prefix_reuse=True,
    needs_hidden_state=True,
    default_min_draft_prob=0.15,
    # above mtp (20), which would take this PER_TOKEN head too but cannot name its sequence
    priority=21,
)

DRAFT_FILE = DraftFileSpec(
    name="gemma4-assistant",
    summary="Gemma 4 assistant (MTP drafter) GGUF: Q-only layers over the trunk's KV, paired with its Gemma 4 model",
    architectures=ARCHITECTURES,
    loader="verispec_gemma4_assistant.loader:load",
    trunks=("gemma4",),
)

register_speculators = registers(SPEC)
register_draft_files = registers(DRAFT_FILE)
