"""verispec's conformance suites on the tiny glm-dsa fixtures: TrunkConformance in fp32 and int8,
SpeculatorConformance with `ngram` and `mtp` on this trunk (int8), and the state a keep leaves.

The prompt (32 tokens) is longer than index_topk (24 / 17), so from there on every row's keys
are a strict top-k subset and a keep or truncate that left a wrong indexer key or latent row
behind would change which keys later rows read. int8 declares `spec_batch_invariant` (decode and
verify rows run per row: the absorbed MLA and the indexer one row at a time), so the suites demand
bitwise-equal rows there; fp32 is held to the suite's atol.
"""
import pytest
import torch
from verispec.seams import Segment, Trunk, declared
from verispec.testing import SpeculatorConformance, TrunkConformance, forward_one
from verispec_glm5.loader_glm_dsa import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models

PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26,
          43, 38, 32, 79, 50]


@pytest.fixture(scope="module", params=[("shared", "float32"), ("shared", "int8"), ("full", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tiny_dsa_fixture):
    name, dtype = request.param
    return load(tiny_dsa_fixture(name)[2], dtype=dtype)


class TestGlmDsaConformance(TrunkConformance):
    prompt = PROMPT

    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert loaded.config.index_topk < len(PROMPT)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8


def _state_rows(trunk, seq):
    """Each layer's committed latent rows and indexer keys (None on a shared layer)."""
    state = trunk._state(seq)
    n = state.seq_len
    rows = []
    for cache in state.layers:
        keys = None if cache.index_keys is None else cache.index_keys.read(n).clone()
        rows.append((cache.latent.read(n).clone(), keys))
    return rows


@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_keep_of_a_rejected_tail_leaves_a_plain_runs_caches(loaded, accepted):
    """A 6-row verify of which `accepted` rows are kept, then two more tokens: the latent and indexer
    key caches and the next rows' logits are a plain run's (bitwise in int8)."""
    draft, after = [17, 23, 99, 4, 61, 8], [33, 7]
    plain = loaded.new_sequence()
    forward_one(loaded, plain, PROMPT + draft[:accepted], logits="none")
    expected = forward_one(loaded, plain, after).logits

    seq = loaded.new_sequence()
    forward_one(loaded, seq, PROMPT, logits="none")
    loaded.forward([Segment(seq, torch.tensor(draft), verify=True)])
    loaded.keep(seq, accepted)
    assert loaded.seq_len(seq) == len(PROMPT) + accepted
    got = forward_one(loaded, seq, after).logits
    exact = declared(loaded, "spec_batch_invariant")
    for (lat, keys), (lat_p, keys_p) in zip(_state_rows(loaded, seq), _state_rows(loaded, plain)):
        if exact:
            assert torch.equal(lat, lat_p) and (keys is None or torch.equal(keys, keys_p))
        else:
            torch.testing.assert_close(lat, lat_p, atol=1e-5, rtol=0)
            if keys is not None:
                torch.testing.assert_close(keys, keys_p, atol=1e-5, rtol=0)
    if exact:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_sequence_nbytes_counts_latent_and_indexer_rows(loaded):
    """Per position and layer: kvL + r latent floats, plus ID indexer floats on full layers, in
    blocks of 64 positions."""
    c = loaded.config
    per_position = sum(4 * (c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if full else 0))
                       for full in c.indexer_full)
    assert loaded.sequence_nbytes(1) == 64 * per_position
    assert loaded.sequence_nbytes(65) == 128 * per_position
    seq = loaded.new_sequence()
    forward_one(loaded, seq, PROMPT, logits="none")
    assert loaded.sequence_held_nbytes(seq) == loaded.sequence_nbytes(len(PROMPT))


@pytest.fixture(scope="module")
def int8_trunk(tiny_dsa_fixture):
    return load(tiny_dsa_fixture("shared")[2], dtype="int8")


class TestNGramOnGlmDsa(SpeculatorConformance):
    """The speculator suite with `ngram`, on this trunk instead of the toy."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self):
        ngram = pytest.importorskip("verispec_ngram.speculator")
        return lambda: ngram.NGramSpeculator(max_draft_tokens=4)


class TestMtpOnGlmDsa(SpeculatorConformance):
    """The speculator suite with `mtp` over this trunk's NextN head."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self, int8_trunk):
        speculator = pytest.importorskip("verispec_mtp_nextn.speculator")
        return lambda: speculator.MtpSpeculator(int8_trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
