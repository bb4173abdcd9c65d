"""verispec: speculative decoding as plugins. See docs/design.md; `verispec.load` is the Python API."""
from verispec.hookspecs import hookimpl, registers
from verispec.specs import CheckpointSpec, Decline, DraftFileSpec, SpeculatorSpec, TrunkSpec

__all__ = ["hookimpl", "registers", "SpeculatorSpec", "TrunkSpec", "DraftFileSpec", "CheckpointSpec", "Decline", "load"]
__version__ = "0.1.0"


def load(model=None, **options):
    """Load a model (alias, GGUF path, or the embedded default) into an InferenceEngine."""
    from verispec.api import load as _load

    return _load(model, **options)
