"""verispec's target conformance suite on the tiny Gemma 3 and Gemma 4 trunks."""
import pytest
from tiny_gemma import TINY_GEMMA4_PLE, make_hf_gemma4, write_gemma4_gguf

from verispec.testing import TargetConformance


class TestGemma3Int8(TargetConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, load_tiny):
        return load_tiny("int8")


class TestGemma3Float32(TargetConformance):
    """Not batch-invariant: the suite compares rows within `atol` instead of bitwise."""

    num_drift_steps = 60  # greedy streams agree as long as no near-tie falls inside ~1e-6

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, load_tiny):
        return load_tiny("float32")


class TestGemma4Int8(TargetConformance):
    """PLE + KV-shared layers: shared layers read their source layer's ring during verifies."""

    num_drift_steps = 120

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory):
        from verispec_gemma4.loader import load

        path = write_gemma4_gguf(tmp_path_factory.mktemp("gemma4") / "conformance.gguf", make_hf_gemma4(TINY_GEMMA4_PLE))
        return load(path, dtype="int8", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)
