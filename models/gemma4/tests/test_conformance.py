"""verispec's trunk conformance suite on the tiny Gemma 3 and Gemma 4 trunks.

Every class uses a 24-token prompt: three times the tiny window (8) and past the rings
(8 + 16 - 1 = 23 slots), so the suite's keep case (verifies of up to 16 rows, every kept
count) and its truncation case run with the window crossed and the rings wrapped.
"""
import pytest
from tiny_gemma import TINY_GEMMA3, TINY_GEMMA4_PLE, make_hf_gemma4, write_gemma4_gguf

from verispec.testing import TrunkConformance

#: token_ids(24, seed=21) of tiny_gemma: valid ids of the tiny vocabulary (131).
PROMPT = [39, 58, 24, 36, 117, 26, 70, 76, 113, 55, 91, 43, 23, 21, 67, 47, 57, 108, 70, 34, 15, 85, 22, 11]
RING_SLOTS = TINY_GEMMA3["sliding_window"] + 16 - 1  # conftest.TINY_ROWS: 16-row chunks and verifies


def test_the_prompt_crosses_the_window_and_wraps_the_rings():
    assert len(PROMPT) > RING_SLOTS > 2 * TINY_GEMMA3["sliding_window"]
    assert all(0 <= t < TINY_GEMMA3["vocab_size"] for t in PROMPT)
    assert TINY_GEMMA4_PLE["vocab_size"] == TINY_GEMMA3["vocab_size"] and TINY_GEMMA4_PLE["sliding_window"] == 8
    assert TrunkConformance.max_keep_rows <= 16  # within the rings' verify slack


class TestGemma3Int8(TrunkConformance):
    prompt = PROMPT

    @pytest.fixture(scope="class")
    @classmethod
    def trunk(cls, load_tiny):
        return load_tiny("int8")


class TestGemma3Float32(TrunkConformance):
    """Not batch-invariant: the suite compares rows within `atol` instead of bitwise."""

    prompt = PROMPT
    num_drift_steps = 60  # greedy streams agree as long as no near-tie falls inside ~1e-6

    @pytest.fixture(scope="class")
    @classmethod
    def trunk(cls, load_tiny):
        return load_tiny("float32")


class TestGemma4Int8(TrunkConformance):
    """PLE + KV-shared layers: shared layers read their source layer's ring during verifies."""

    prompt = PROMPT
    num_drift_steps = 120

    @pytest.fixture(scope="class")
    @classmethod
    def trunk(cls, tmp_path_factory):
        from verispec_gemma4.loader import load

        path = write_gemma4_gguf(tmp_path_factory.mktemp("gemma4") / "conformance.gguf", make_hf_gemma4(TINY_GEMMA4_PLE))
        return load(path, dtype="int8", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)
