"""Fixtures for the qwen35 tests; the helpers live in `tiny_qwen35.py` (on pytest's
`pythonpath`, set in the workspace's pyproject.toml)."""
import pytest
from tiny_qwen35 import TINY_CONFIGS, build_hf_model, write_fixture

from verispec.testing import built_once


def _build(name, directory):
    model, mtp = build_hf_model(name)
    return model, mtp, write_fixture(model, directory / f"{name}.gguf", mtp=mtp, options=TINY_CONFIGS[name][3])


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """tiny_fixture(name) -> (transformers model, MTP state dict or None, GGUF path), once per session."""
    return built_once(tmp_path_factory, _build)
