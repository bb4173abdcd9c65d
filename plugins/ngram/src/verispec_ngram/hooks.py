"""Entry point of verispec-ngram: registers the `ngram` speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `NGramSpeculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import SpeculatorSpec

SPEC = SpeculatorSpec(
    name="ngram",
    summary="n-gram lookup: drafts what followed the last 1-4 tokens earlier in the sequence; no weights",
    factory="verispec_ngram.speculator:create",
    requires_draft_head=False,
    needs_hidden_state=False,
    can_arm_after_prefix_reuse=True,
    default_min_draft_prob=0.0,
    priority=10,
)

register_speculators = registers(SPEC)
