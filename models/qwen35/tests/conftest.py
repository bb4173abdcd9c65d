"""Fixtures for the qwen35 tests; the helpers live in `tiny_qwen35.py` (put on sys.path here:
the workspace runs pytest with --import-mode=importlib)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_qwen35 import TINY_CONFIGS, build_hf_model, write_fixture  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny configs are thousands of small ops: one thread is ~10x faster than two on a shared
    2-core runner (OpenMP spin-waits), and CI stays well under its budget."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """tiny_fixture(name) -> (transformers model, MTP state dict or None, GGUF path), once per session."""
    built = {}

    def make(name: str):
        if name not in built:
            model, mtp = build_hf_model(name)
            options = TINY_CONFIGS[name][3]
            path = write_fixture(model, tmp_path_factory.mktemp(name) / f"{name}.gguf", mtp=mtp,
                                 options=options)
            built[name] = (model, mtp, path)
        return built[name]

    return make
