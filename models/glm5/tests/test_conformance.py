"""verispec's conformance suites on each architecture's tiny fixtures: TrunkConformance in fp32 and
int8, SpeculatorConformance with the `ngram` and `mtp` speculators running on the trunk (int8), and
what a keep leaves in each architecture's own state.

int8 declares `spec_batch_invariant` (every linear is int8pack_mm; the MoE router runs one row at a
time, each expert over the rows routed to it; glm-dsa's absorbed MLA and indexer and glm5-next's
KDA run per row), so the suites demand bitwise-equal rows there; fp32 is held to the suite's atol.
glm-dsa's prompt (32 tokens) is longer than index_topk (24 / 17), so every later row's keys are a
strict top-k subset and a keep or truncate that left a wrong indexer key or latent row behind would
change which keys later rows read. glm5-next's (30) is longer than index_topk (16, kpool 4) and not
a whole number of pools, so a verify's draft rows complete a pool that a keep rejecting them must
leave incomplete again.
"""
import pytest
import torch
from glm_archs import ARCHS
from verispec.seams import Segment, Trunk, declared
from verispec.testing import SpeculatorConformance, TrunkConformance, forward_one

pytest.importorskip("transformers")  # the fixtures are written from transformers models

CASES = [(arch.name, name, dtype) for arch in ARCHS.values() for name, dtype in arch.conformance]
DSA_PROMPT, G5N_PROMPT = ARCHS["glm-dsa"].prompt, ARCHS["glm5-next"].prompt
G5N_DRAFT = [17, 23, 99, 4, 61, 8, 33, 7, 140, 2, 55, 19, 88, 120, 6, 71, 90]  # 16 draft rows and one after


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(p))
def case(request, tiny_glm):
    """(the architecture, its trunk loaded from one of its conformance files)."""
    arch, name, dtype = request.param
    return ARCHS[arch], ARCHS[arch].load(tiny_glm(arch, name)[2], dtype=dtype)


class TestGlmConformance(TrunkConformance):
    @pytest.fixture
    def trunk(self, case):
        self.prompt = case[0].prompt  # the suite reads self.prompt (a per-architecture length)
        return case[1]


def test_declarations_are_truthful(case):
    arch, loaded = case
    assert isinstance(loaded, Trunk)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8
    if arch.name == "glm4moe":
        assert loaded.view().tap_feature_size(None) == loaded.hidden_size
        assert (loaded.draft_head is not None) == bool(loaded.config.num_nextn_predict_layers)
    else:
        assert loaded.config.index_topk < len(arch.prompt)
    if arch.name == "glm5-next":
        assert len(arch.prompt) % loaded.config.index_kpool


def _trunks_of(arch):
    """The `case` params of one architecture (for its own state checks)."""
    return pytest.mark.parametrize("case", [c for c in CASES if c[0] == arch], indirect=True,
                                   ids=lambda p: "-".join(p))


@_trunks_of("glm4moe")
def test_truncate_to_any_prefix_is_exact(case):
    """Every glm4moe layer is attention over a PagedKVCache, so a sequence cuts back to any prefix."""
    _, loaded = case
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


def _dsa_state_rows(trunk, seq):
    """Each glm-dsa layer's committed latent rows and indexer keys (None on a shared layer)."""
    state = trunk._state(seq)
    n = state.seq_len
    rows = []
    for cache in state.layers:
        keys = None if cache.index_keys is None else cache.index_keys.read(n).clone()
        rows.append((cache.latent.read(n).clone(), keys))
    return rows


@_trunks_of("glm-dsa")
@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_keep_of_a_rejected_tail_leaves_a_plain_runs_caches(case, accepted):
    """glm-dsa: a 6-row verify of which `accepted` rows are kept, then two more tokens: the latent
    and indexer key caches and the next rows' logits are a plain run's (bitwise in int8)."""
    _, loaded = case
    draft, after = [17, 23, 99, 4, 61, 8], [33, 7]
    plain = loaded.new_sequence()
    forward_one(loaded, plain, DSA_PROMPT + draft[:accepted], logits="none")
    expected = forward_one(loaded, plain, after).logits

    seq = loaded.new_sequence()
    forward_one(loaded, seq, DSA_PROMPT, logits="none")
    loaded.forward([Segment(seq, torch.tensor(draft), verify=True)])
    loaded.keep(seq, accepted)
    assert loaded.seq_len(seq) == len(DSA_PROMPT) + accepted
    got = forward_one(loaded, seq, after).logits
    exact = declared(loaded, "spec_batch_invariant")
    for (lat, keys), (lat_p, keys_p) in zip(_dsa_state_rows(loaded, seq), _dsa_state_rows(loaded, plain)):
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


@_trunks_of("glm-dsa")
def test_dsa_sequence_nbytes_counts_latent_and_indexer_rows(case):
    """Per position and layer: kvL + r latent floats, plus ID indexer floats on full layers, in
    blocks of 64 positions."""
    _, loaded = case
    c = loaded.config
    per_position = sum(4 * (c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if full else 0))
                       for full in c.indexer_full)
    assert loaded.sequence_nbytes(1) == 64 * per_position
    assert loaded.sequence_nbytes(65) == 128 * per_position
    seq = loaded.new_sequence()
    forward_one(loaded, seq, DSA_PROMPT, logits="none")
    assert loaded.sequence_held_nbytes(seq) == loaded.sequence_nbytes(len(DSA_PROMPT))


def _kda_states(trunk, seq):
    return [{k: v.clone() for k, v in s.values.items()} for s, kda in
            zip(trunk._state(seq).layers, trunk.config.kda_layers) if kda]


def test_glm5next_keep_at_every_row_count_is_a_plain_run(tiny_glm):
    """glm5-next int8: verifies of widths 1..16 after the prompt, each kept at every row count a in
    0..w, leave the KDA states (conv windows and delta state) bitwise those of a plain
    one-row-at-a-time run of the prompt + a draft tokens, and the next row's logits bitwise the
    plain run's (which reads the latent and indexer rows, and pools that the rejected rows had
    completed)."""
    trunk = ARCHS["glm5-next"].load(tiny_glm("glm5-next")[2], dtype="int8")
    plain = trunk.new_sequence()
    forward_one(trunk, plain, G5N_PROMPT, logits="none")
    states, logits = [_kda_states(trunk, plain)], []
    for t in G5N_DRAFT:
        logits.append(forward_one(trunk, plain, [t]).logits)
        states.append(_kda_states(trunk, plain))
    base = trunk.new_sequence()
    forward_one(trunk, base, G5N_PROMPT, logits="none")
    for width in range(1, 17):
        for accepted in range(width + 1):
            seq = trunk.fork(base, len(G5N_PROMPT))
            trunk.forward([Segment(seq, torch.tensor(G5N_DRAFT[:width]), verify=True)])
            trunk.keep(seq, accepted)
            assert trunk.seq_len(seq) == len(G5N_PROMPT) + accepted
            for got, want in zip(_kda_states(trunk, seq), states[accepted]):
                assert all(torch.equal(got[k], want[k]) for k in want), (width, accepted)
            after = forward_one(trunk, seq, [G5N_DRAFT[accepted]]).logits
            assert torch.equal(after, logits[accepted]), (width, accepted)
            trunk.release(seq)


@_trunks_of("glm5-next")
def test_a_pool_completed_by_rejected_rows_is_incomplete_after_keep(case):
    """glm5-next: prompt 30 = 7 pools + 2: a 4-row verify completes pool 7 (positions 28..31);
    keeping 1 row leaves 31 positions, so the next row reads positions 28..30 as its unscored tail,
    as a plain run does."""
    _, loaded = case
    plain = loaded.new_sequence()
    forward_one(loaded, plain, G5N_PROMPT + G5N_DRAFT[:1], logits="none")
    expected = forward_one(loaded, plain, G5N_DRAFT[1:3]).logits
    other = loaded.new_sequence()
    forward_one(loaded, other, G5N_PROMPT, logits="none")
    loaded.forward([Segment(other, torch.tensor(G5N_DRAFT[0:4]), verify=True)])
    loaded.keep(other, 1)
    got = forward_one(loaded, other, G5N_DRAFT[1:3]).logits
    if declared(loaded, "spec_batch_invariant"):
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@_trunks_of("glm5-next")
def test_g5n_sequence_nbytes_counts_recurrent_latent_and_indexer_state(case):
    """Per MLA layer and position kvL latent + 2·ID indexer floats (blocks of 64 positions); per
    KDA layer the conv windows 3·di·(K-1) and the delta state H·hd·hd floats."""
    _, loaded = case
    c = loaded.config
    di = c.num_attention_heads * c.linear_head_dim
    kda_floats = 3 * di * (c.linear_conv_kernel_dim - 1) + c.num_attention_heads * c.linear_head_dim ** 2
    recurrent = sum(4 * kda_floats for kda in c.kda_layers if kda)
    per_position = sum(4 * (c.kv_lora_rank + 2 * c.index_head_dim) for kda in c.kda_layers if not kda)
    assert loaded.sequence_nbytes(1) == recurrent + 64 * per_position
    assert loaded.sequence_nbytes(65) == recurrent + 128 * per_position
    seq = loaded.new_sequence()
    forward_one(loaded, seq, G5N_PROMPT, logits="none")
    assert loaded.sequence_held_nbytes(seq) == loaded.sequence_nbytes(len(G5N_PROMPT))


@pytest.fixture(scope="module", params=list(ARCHS))
def int8_trunk(request, tiny_glm):
    return ARCHS[request.param].load(tiny_glm(request.param)[2], dtype="int8")


class TestNGramOnGlm(SpeculatorConformance):
    """The speculator suite with `ngram`, on each architecture's trunk instead of the toy."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self):
        ngram = pytest.importorskip("verispec_ngram.speculator")
        return lambda: ngram.NGramSpeculator(max_draft_tokens=4)


class TestMtpOnGlm(SpeculatorConformance):
    """The speculator suite with `mtp` over each architecture's NextN head."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self, int8_trunk):
        speculator = pytest.importorskip("verispec_mtp_nextn.speculator")
        return lambda: speculator.MtpSpeculator(int8_trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
