"""Fixtures for the gemma tests; the helpers they use live in `tiny_gemma.py` (on pytest's
`pythonpath`, set in the workspace's pyproject.toml)."""
import pytest
from tiny_gemma import make_hf_gemma3, write_gemma3_gguf


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
