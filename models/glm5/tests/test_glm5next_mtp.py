"""The glm5-next NextN draft head: its steps against transformers' MtpLayer over a plain-residual
Glm5NextTextAttention + Glm5NextTextMoE layer (`tiny_glm5next.nextn_reference`), through commits,
keeps and gaps, and exact streams under the `mtp` speculator.

The head's runs reach 31 positions, past index_topk 16 with kpool 4: its own indexer then selects
4 of its complete pools plus its tail, as the reference layer's does."""
import pytest
import tiny_glm5next
import torch
from verispec.seams import DraftHead, DraftHeadKind
from verispec.testing import SpeculatorConformance
from verispec_glm5.loader_glm5next import load

pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_glm5next_fixture):
    hf_model, path = tiny_glm5next_fixture("flash")
    head = load(path, dtype="float32").draft_head
    tokens = torch.randint(0, hf_model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    return hf_model, head, tokens, tiny_glm5next.trunk_hidden(hf_model, tokens)


def test_draft_steps_match_transformers(setup):
    """Commits in chunks, a first step per chunk (catch-up folded in) and one chained step on the
    head's own row, provisional rows dropped by keep: every logits row equals the reference over
    the pairs (h[j], t[j+1]) (+ the chained pair)."""
    hf_model, head, tokens, hidden = setup
    assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
    assert head.draft_head_resumes_after_gap
    ref_logits, ref_hidden = tiny_glm5next.nextn_reference(hf_model, tokens[1:], hidden[:-1])
    state = head.new_state()
    head.draft_catch_up(state, tokens[:10].tolist(), hidden[:10], 0)
    pos = 10
    for kept in (3, 1, 5, 2, 4, 6):
        logits, h_out = head.draft_step(state, int(tokens[pos]), hidden[pos - 1], pos)
        torch.testing.assert_close(logits, ref_logits[pos - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(h_out, ref_hidden[pos - 1], atol=ATOL, rtol=0)
        draft = int(logits.argmax())
        chained, _ = head.draft_step(state, draft, h_out, pos + 1)
        pairs = torch.cat([tokens[1:pos + 1], torch.tensor([draft])])
        rows = torch.cat([hidden[:pos], ref_hidden[pos - 1:pos]])
        expected, _ = tiny_glm5next.nextn_reference(hf_model, pairs, rows)
        torch.testing.assert_close(chained, expected[-1], atol=ATOL, rtol=0)
        head.keep(state, kept)
        head.draft_catch_up(state, tokens[pos:pos + kept].tolist(), hidden[pos:pos + kept], pos)
        pos += kept
    assert pos > 16 + 4  # past index_topk + kpool: the head's indexer selected a strict subset


def test_head_restarts_after_a_gap(setup):
    """Tokens committed without hidden rows: the head's rows restart at the next pair it can form
    (its pools then count from there), and steps equal the reference over only those pairs."""
    hf_model, head, tokens, hidden = setup
    state = head.new_state()
    head.draft_catch_up(state, tokens[:8].tolist(), hidden[:8], 0)
    head.draft_step(state, int(tokens[8]), hidden[7], 8)
    head.keep(state, 1)
    head.draft_catch_up(state, tokens[8:14].tolist(), None, 8)  # a gap: no hidden rows
    head.draft_catch_up(state, tokens[14:30].tolist(), hidden[14:30], 14)
    logits, _ = head.draft_step(state, int(tokens[30]), hidden[29], 30)
    expected, _ = tiny_glm5next.nextn_reference(hf_model, tokens[15:31], hidden[14:30])
    torch.testing.assert_close(logits, expected[-1], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def int8_trunk(tiny_glm5next_fixture):
    return load(tiny_glm5next_fixture("flash")[1], dtype="int8")


class TestMtpOnGlm5Next(SpeculatorConformance):
    """The speculator suite with `mtp` over this trunk's NextN head."""

    @pytest.fixture
    def toy_trunk(self, int8_trunk):
        return int8_trunk

    @pytest.fixture
    def make_speculator(self, int8_trunk):
        speculator = pytest.importorskip("verispec_mtp_nextn.speculator")
        return lambda: speculator.MtpSpeculator(int8_trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
