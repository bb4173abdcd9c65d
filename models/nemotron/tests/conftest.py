"""Fixtures for the Nemotron-H tests; the helpers they use live in `tiny_nemotron.py`.

Test modules import `tiny_nemotron` directly: this directory is put on sys.path here because
the workspace runs pytest with --import-mode=importlib (no rootdir-relative imports).
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_nemotron import build_hf_model, write_fixture


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core box OpenMP's spin-waits
    make each small op far slower while other processes run; restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
