"""Entry point of verispec-suffix: registers the `suffix` speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `SuffixSpeculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import SpeculatorSpec

SPEC = SpeculatorSpec(
    name="suffix",
    summary="suffix decoding: drafts the likeliest continuation of what the last tokens matched in this request "
            "or in earlier requests' outputs; no weights",
    factory="verispec_suffix.speculator:create",
    requires_draft_head=False,
    needs_hidden_state=False,
    can_arm_after_prefix_reuse=True,
    # propose returns each draft's probability: the cost model verifies the prefix that pays
    scores_drafts=True,
    # a drafted token's estimated probability (along the matched path) must reach this; ArcticInference's default
    default_min_draft_prob=0.1,
    priority=9,  # below ngram: `auto` keeps its choice until sessions are benchmarked
)


register_speculators = registers(SPEC)
