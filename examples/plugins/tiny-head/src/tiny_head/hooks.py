"""The entry point `verispec plugins` loads: the speculator and the drafter file format, no torch."""
from verispec import DraftFileSpec, SpeculatorSpec, hookimpl

#: the GGUF `general.architecture` of the head files `python -m tiny_head.make_head` writes.
ARCHITECTURE = "tiny-head"

SPEC = SpeculatorSpec(
    name="tiny-head",
    summary="a learned linear next-row head over the trunk's last hidden row (--draft-model head.gguf); "
            "gate: the head's top-1 probability",
    factory="tiny_head.speculator:create",
    requires_draft_head=True,          # declines at once without a head file loaded
    can_arm_after_prefix_reuse=True,   # reads only ctx.hidden_prev: nothing to rebuild after a reused prefix
    needs_hidden_state=True,           # the loop asks the trunk for hidden rows and passes them
    default_min_draft_prob=0.3,        # --spec-pmin default, in this head's units (its top-1 probability)
    priority=15,                       # barely matters: its file names it, and without one it declines
)


@hookimpl
def register_speculators(register):
    register(SPEC)


@hookimpl
def register_draft_files(register):
    register(DraftFileSpec(
        name="tiny-head",
        summary="a tiny-head drafter GGUF (a [D, 2D] next-row matrix), bound to the model it was fitted on",
        architectures=(ARCHITECTURE,),
        loader="tiny_head.head:load",
        speculators=("tiny-head",),    # auto / draft-head / block drive its heads with tiny-head
    ))
