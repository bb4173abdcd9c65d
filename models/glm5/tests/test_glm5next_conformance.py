"""verispec's conformance suites on the tiny glm5-next fixture: TrunkConformance in fp32 and int8,
SpeculatorConformance with `ngram` (int8), and the state a keep leaves.

The prompt (30 tokens) is longer than index_topk (16, kpool 4) and not a whole number of pools, so
a verify's draft rows complete a pool that a keep rejecting them must leave incomplete again; a
keep that left a wrong KDA state, latent row or indexer row behind changes the next row's logits.
int8 declares `spec_batch_invariant` (every op per row), so keep is held bitwise to a plain run.
"""
import pytest
import torch
from verispec.seams import Segment, Trunk, declared
from verispec.testing import SpeculatorConformance, TrunkConformance, forward_one
from verispec_glm5.loader_glm5next import load

pytest.importorskip("transformers")  # the fixture is written from a transformers model

PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26,
          43, 38, 32]
DRAFT = [17, 23, 99, 4, 61, 8, 33, 7, 140, 2, 55, 19, 88, 120, 6, 71, 90]  # 16 draft rows and one after


@pytest.fixture(scope="module", params=["float32", "int8"])
def loaded(request, tiny_glm5next_fixture):
    return load(tiny_glm5next_fixture("flash")[1], dtype=request.param)


class TestGlm5NextConformance(TrunkConformance):
    prompt = PROMPT

    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert loaded.config.index_topk < len(PROMPT) and len(PROMPT) % loaded.config.index_kpool
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8


def _kda_states(trunk, seq):
    return [{k: v.clone() for k, v in s.values.items()} for s, kda in
            zip(trunk._state(seq).layers, trunk.config.kda_layers) if kda]


def test_keep_at_every_row_count_is_a_plain_run(tiny_glm5next_fixture):
    """int8: verifies of widths 1..16 after the prompt, each kept at every row count a in 0..w,
    leave the KDA states (conv windows and delta state) bitwise those of a plain one-row-at-a-time
    run of the prompt + a draft tokens, and the next row's logits bitwise the plain run's
    (which reads the latent and indexer rows, and pools that the rejected rows had completed)."""
    trunk = load(tiny_glm5next_fixture("flash")[1], dtype="int8")
    plain = trunk.new_sequence()
    forward_one(trunk, plain, PROMPT, logits="none")
    states, logits = [_kda_states(trunk, plain)], []
    for t in DRAFT:
        logits.append(forward_one(trunk, plain, [t]).logits)
        states.append(_kda_states(trunk, plain))
    base = trunk.new_sequence()
    forward_one(trunk, base, PROMPT, logits="none")
    for width in range(1, 17):
        for accepted in range(width + 1):
            seq = trunk.fork(base, len(PROMPT))
            trunk.forward([Segment(seq, torch.tensor(DRAFT[:width]), verify=True)])
            trunk.keep(seq, accepted)
            assert trunk.seq_len(seq) == len(PROMPT) + accepted
            for got, want in zip(_kda_states(trunk, seq), states[accepted]):
                assert all(torch.equal(got[k], want[k]) for k in want), (width, accepted)
            after = forward_one(trunk, seq, [DRAFT[accepted]]).logits
            assert torch.equal(after, logits[accepted]), (width, accepted)
            trunk.release(seq)


def test_a_pool_completed_by_rejected_rows_is_incomplete_after_keep(loaded):
    """Prompt 30 = 7 pools + 2: a 4-row verify completes pool 7 (positions 28..31); keeping 1 row
    leaves 31 positions, so the next row reads positions 28..30 as its unscored tail, as a plain
    run does."""
    plain = loaded.new_sequence()
    forward_one(loaded, plain, PROMPT + DRAFT[:1], logits="none")
    expected = forward_one(loaded, plain, DRAFT[1:3]).logits
    other = loaded.new_sequence()
    forward_one(loaded, other, PROMPT, logits="none")
    loaded.forward([Segment(other, torch.tensor(DRAFT[0:4]), verify=True)])
    loaded.keep(other, 1)
    got = forward_one(loaded, other, DRAFT[1:3]).logits
    if declared(loaded, "spec_batch_invariant"):
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_sequence_nbytes_counts_recurrent_latent_and_indexer_state(loaded):
    """Per MLA layer and position kvL latent + 2·ID indexer floats (blocks of 64 positions); per
    KDA layer the conv windows 3·di·(K-1) and the delta state H·hd·hd floats."""
    c = loaded.config
    di = c.num_attention_heads * c.linear_head_dim
    kda_floats = 3 * di * (c.linear_conv_kernel_dim - 1) + c.num_attention_heads * c.linear_head_dim ** 2
    recurrent = sum(4 * kda_floats for kda in c.kda_layers if kda)
    per_position = sum(4 * (c.kv_lora_rank + 2 * c.index_head_dim) for kda in c.kda_layers if not kda)
    assert loaded.sequence_nbytes(1) == recurrent + 64 * per_position
    assert loaded.sequence_nbytes(65) == recurrent + 128 * per_position
    seq = loaded.new_sequence()
    forward_one(loaded, seq, PROMPT, logits="none")
    assert loaded.sequence_held_nbytes(seq) == loaded.sequence_nbytes(len(PROMPT))


@pytest.fixture(scope="module")
def int8_trunk(tiny_glm5next_fixture):
    return load(tiny_glm5next_fixture("flash")[1], dtype="int8")


class TestNGramOnGlm5Next(SpeculatorConformance):
    """The speculator suite with `ngram`, on this trunk instead of the toy."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self):
        ngram = pytest.importorskip("verispec_ngram.speculator")
        return lambda: ngram.NGramSpeculator(max_draft_tokens=4)
