"""Fixtures for the llama/qwen2 tests; the helpers they use live in `tiny_llama.py` and
`llama_real_checks.py`.

Test modules import those directly: this directory is put on sys.path here because the
workspace runs pytest with --import-mode=importlib (no rootdir-relative imports).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_llama import build_hf_model, write_fixture


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """tiny_fixture(name) -> (transformers model, GGUF path); built once per session."""
    built = {}

    def make(name: str):
        if name not in built:
            model = build_hf_model(name)
            built[name] = (model, write_fixture(model, tmp_path_factory.mktemp(name) / f"{name}.gguf"))
        return built[name]

    return make
