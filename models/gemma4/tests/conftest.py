"""Fixtures for the gemma tests; the helpers they use live in `tiny_gemma.py`.

Test modules import `tiny_gemma` directly: this directory is put on sys.path here because
the workspace runs pytest with --import-mode=importlib (no rootdir-relative imports).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import torch
from tiny_gemma import make_hf_gemma3, write_gemma3_gguf


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core box OpenMP's spin-waits
    make each forward ~100x slower while other processes run; restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_gemma3():
    return make_hf_gemma3()


@pytest.fixture(scope="session")
def gemma3_gguf(hf_gemma3, tmp_path_factory):
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf", hf_gemma3)


#: tests use 16-row chunks and rings of 8 + 16 - 1 slots, so their 30..70-token sequences
#: wrap the rings (the defaults, 64 and 65 rows, would not wrap before ~72 tokens).
TINY_ROWS = {"max_rows_per_forward": 16, "max_verify_rows": 16}


@pytest.fixture(scope="session")
def load_tiny(gemma3_gguf):
    """load_tiny(dtype, **loader_options) -> a fresh trunk from the tiny gemma3 GGUF (no weight cache)."""
    from verispec_gemma4.loader import load

    def _load(dtype="int8", **options):
        return load(gemma3_gguf, dtype=dtype, use_cache=False, tokenizer=False, **{**TINY_ROWS, **options})

    return _load
