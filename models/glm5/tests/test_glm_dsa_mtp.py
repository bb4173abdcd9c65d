"""The glm-dsa NextN draft head: its steps against transformers' MtpLayer over a GlmMoeDsaDecoderLayer
(`tiny_glm_dsa.nextn_reference`), its per-sequence latent rows through commits, keeps and gaps,
and exact streams under the `mtp` speculator (when verispec-mtp-nextn is installed).

The head's runs here reach 30 positions, past index_topk (24): its own indexer restricts its
attention in the later steps, as the reference layer's does."""
import pytest
import torch
from tiny_glm_dsa import nextn_reference
from verispec.seams import DraftHead, DraftHeadKind
from verispec_glm5.loader_glm_dsa import load

pytest.importorskip("transformers")

ATOL = 1e-4


def _reference_and_head(tiny_dsa_fixture, n=32):
    hf_model, mtp, path = tiny_dsa_fixture("shared")
    head = load(path, dtype="float32").draft_head
    tokens = torch.randint(0, hf_model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = hf_model(tokens[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed [n, D]
    return hf_model, mtp, head, tokens, hidden


def _reference(hf_model, mtp, tokens, hidden, positions):
    with torch.no_grad():
        return nextn_reference(hf_model, mtp, tokens, hidden, positions)


def test_draft_steps_match_transformers(tiny_dsa_fixture):
    """Commits in chunks as the loop makes them, a first step per chunk (catch-up folded in) and one
    chained step on the head's own row, provisional rows dropped by keep: every logits row equals
    the reference MTP layer over the pairs (h[j], t[j+1]) at position j+1 (+ the chained pair)."""
    hf_model, mtp, head, tokens, hidden = _reference_and_head(tiny_dsa_fixture)
    assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
    assert head.draft_head_resumes_after_gap
    ref_logits, ref_hidden = _reference(hf_model, mtp, tokens[1:], hidden[:-1], torch.arange(1, len(tokens)))
    state = head.new_state()
    head.draft_catch_up(state, tokens[:10].tolist(), hidden[:10], 0)
    pos = 10
    for kept in (3, 1, 5, 2, 4, 6):
        logits, h_out = head.draft_step(state, int(tokens[pos]), hidden[pos - 1], pos)
        torch.testing.assert_close(logits, ref_logits[pos - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(h_out, ref_hidden[pos - 1], atol=ATOL, rtol=0)
        draft = int(logits.argmax())
        chained, _ = head.draft_step(state, draft, h_out, pos + 1)
        expected, _ = _reference(hf_model, mtp, torch.cat([tokens[1:pos + 1], torch.tensor([draft])]),
                                 torch.cat([hidden[:pos], ref_hidden[pos - 1:pos]]), torch.arange(1, pos + 2))
        torch.testing.assert_close(chained, expected[-1], atol=ATOL, rtol=0)
        head.keep(state, kept)
        head.draft_catch_up(state, tokens[pos:pos + kept].tolist(), hidden[pos:pos + kept], pos)
        pos += kept
    assert pos > 24  # past index_topk: the head's indexer selected a strict subset


def test_head_restarts_after_a_gap(tiny_dsa_fixture):
    """Tokens committed without hidden rows (prefix reuse): the head's rows restart at the next pair
    it can form, and steps equal the reference run over only those pairs."""
    hf_model, mtp, head, tokens, hidden = _reference_and_head(tiny_dsa_fixture)
    state = head.new_state()
    head.draft_catch_up(state, tokens[:8].tolist(), hidden[:8], 0)
    head.draft_step(state, int(tokens[8]), hidden[7], 8)
    head.keep(state, 1)
    head.draft_catch_up(state, tokens[8:14].tolist(), None, 8)  # a gap: no hidden rows
    head.draft_catch_up(state, tokens[14:20].tolist(), hidden[14:20], 14)
    logits, _ = head.draft_step(state, int(tokens[20]), hidden[19], 20)
    # pairs j = 14..19
    expected, _ = _reference(hf_model, mtp, tokens[15:21], hidden[14:20], torch.arange(15, 21))
    torch.testing.assert_close(logits, expected[-1], atol=ATOL, rtol=0)


def test_no_nextn_block_no_head_and_a_declared_absent_block_refused(tiny_dsa_fixture, tmp_path):
    """A file without a NextN block loads with no head; one declaring a NextN block without its
    tensors is refused with the fix named (as glm4moe's loader does)."""
    import tiny_glm_dsa
    from verispec_glm5.modeling_glm4moe import UnsupportedGlm4MoeVariant

    assert load(tiny_dsa_fixture("full")[2], dtype="float32").draft_head is None
    hf_model, mtp, _ = tiny_dsa_fixture("shared")
    n = hf_model.config.num_hidden_layers
    _, _, tensors = tiny_glm_dsa.hf_to_gguf(hf_model, mtp)
    trunk_only = tiny_glm_dsa.write_fixture(hf_model, tmp_path / "trunk-only.gguf", mtp=mtp,
                                            drop_tensors=[t for t in tensors if t.startswith(f"blk.{n}.")])
    with pytest.raises(UnsupportedGlm4MoeVariant, match="drop the key"):
        load(trunk_only, dtype="float32", use_cache=False)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_mtp_speculation_gives_the_plain_stream(tiny_dsa_fixture, dtype):
    speculator_mod = pytest.importorskip("verispec_mtp_nextn.speculator")
    from verispec.testing import run_greedy

    trunk = load(tiny_dsa_fixture("shared")[2], dtype=dtype)
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    plain = run_greedy(trunk, prompt, 40)[0]
    speculator = speculator_mod.MtpSpeculator(trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
    got, ex = run_greedy(trunk, prompt, 40, speculator, max_draft_tokens=4)
    assert got == plain
    assert ex.stats.num_draft_tokens > 0 and ex.stats.num_spec_steps > 0
