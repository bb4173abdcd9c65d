"""Entry point of verispec-draft-model: registers the `draft-model` speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `DraftModelSpeculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import SpeculatorSpec

SPEC = SpeculatorSpec(
    name="draft-model",
    summary="a smaller model of the same tokenizer (--draft-model PATH|ALIAS) drafts up to K tokens greedily; "
            "gate: top-1 prob over its top-10 logits",
    factory="verispec_draft_model.speculator:create",
    requires_draft_head=True,
    # the draft trunk catches up over a reused prefix like a prefill: acceptance is unchanged
    can_arm_after_prefix_reuse=True,
    needs_hidden_state=False,
    # measured on Qwen2.5-Coder 0.5B -> 1.5B (docs/benchmarks.md): 0.5 drafts half as many prose
    # tokens as 0.15 for 18 % fewer accepted, and changes nothing on quotes
    default_min_draft_prob=0.5,
    # above mtp (20): a --draft-model naming a model file is the drafter the user asked for
    priority=25,
)

register_speculators = registers(SPEC)
