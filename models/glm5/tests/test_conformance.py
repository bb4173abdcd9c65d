"""verispec's conformance suites on the tiny glm4moe fixtures: TrunkConformance in fp32 and int8,
SpeculatorConformance with the `ngram` and `mtp` speculators running on this trunk (int8).

int8 declares `spec_batch_invariant` (every linear is int8pack_mm; the router runs one row at a
time, each expert over the rows routed to it, rows adding their experts in ascending order), so
the suites demand bitwise-equal rows there; fp32 (MKL gemm) is held to the suite's atol.
"""
import pytest
from verispec.seams import Trunk, declared
from verispec.testing import SpeculatorConformance, TrunkConformance, forward_one
from verispec_glm5.loader import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models


@pytest.fixture(scope="module", params=[("nextn", "float32"), ("nextn", "int8"), ("grouped", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tiny_fixture):
    name, dtype = request.param
    _, _, path = tiny_fixture(name)
    return load(path, dtype=dtype)


class TestGlm4MoeConformance(TrunkConformance):
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3]

    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8
    assert loaded.view().tap_feature_size(None) == loaded.hidden_size
    assert (loaded.draft_head is not None) == bool(loaded.config.num_nextn_predict_layers)


def test_truncate_to_any_prefix_is_exact(loaded):
    """Every layer is attention over a PagedKVCache, so a sequence cuts back to any prefix."""
    tokens = [3, 4, 5, 9, 9, 7, 1]
    seq = loaded.new_sequence()
    reference = forward_one(loaded, seq, tokens).logits
    for length in range(len(tokens) - 1, 0, -1):
        loaded.truncate(seq, length)
        again = forward_one(loaded, seq, tokens[length:]).logits
        if declared(loaded, "spec_batch_invariant"):
            assert (again == reference[length:]).all(), length
        else:
            assert (again - reference[length:]).abs().max() < 1e-4, length


@pytest.fixture(scope="module")
def int8_trunk(tiny_fixture):
    return load(tiny_fixture("nextn")[2], dtype="int8")


class TestNGramOnGlm4Moe(SpeculatorConformance):
    """The speculator suite with `ngram`, on this trunk instead of the toy."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self):
        ngram = pytest.importorskip("verispec_ngram.speculator")
        return lambda: ngram.NGramSpeculator(max_draft_tokens=4)


class TestMtpOnGlm4Moe(SpeculatorConformance):
    """The speculator suite with `mtp` over this trunk's NextN head."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self, int8_trunk):
        speculator = pytest.importorskip("verispec_mtp_nextn.speculator")
        return lambda: speculator.MtpSpeculator(int8_trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
