"""The entry point `verispec plugins` loads: the speculator's declarations, no torch."""
from verispec import SpeculatorSpec, hookimpl

SPEC = SpeculatorSpec(
    name="line-copy",
    summary="copies the rest of a line that began like the current one (no weights)",
    factory="line_copy.speculator:create",  # imported only when the speculator is built
    requires_draft_head=False,         # weight-free: drafts from tokens alone
    can_arm_after_prefix_reuse=True,   # its state is rebuilt from tokens: it drafts on a chat's second turn
    needs_hidden_state=False,          # no hidden rows: commits are batched until it drafts
    default_min_draft_prob=0.0,        # no gate: a copy has no probability
    priority=8,                        # below suffix (9) and ngram (10): auto keeps theirs; name it to run it
)


@hookimpl
def register_speculators(register):
    register(SPEC)
