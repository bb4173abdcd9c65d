"""Fixtures for the Nemotron-H tests; the helpers they use live in `tiny_nemotron.py` (on
pytest's `pythonpath`, set in the workspace's pyproject.toml)."""
import pytest
from tiny_nemotron import build_hf_model, write_fixture

from verispec.testing import built_once


def _build(name, directory):
    model = build_hf_model(name)
    return model, write_fixture(model, directory / f"{name}.gguf")


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """tiny_fixture(name) -> (transformers model, GGUF path); built once per session."""
    return built_once(tmp_path_factory, _build)
