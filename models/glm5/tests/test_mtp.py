"""The NextN draft head: its steps against transformers' own MTP layer (modeling_layers.MtpModel
over Glm4MoeDecoderLayer), its per-sequence KV through commits, keeps and gaps, and exact
streams under the `mtp` speculator (when verispec-mtp-nextn is installed)."""
import pytest
import torch
from tiny_glm4moe import nextn_reference, write_fixture
from verispec.seams import DraftHead, DraftHeadKind
from verispec_glm5.loader import load

pytest.importorskip("transformers")

ATOL = 1e-4


def _reference_and_head(tiny_fixture, n=30):
    hf_model, mtp, path = tiny_fixture("nextn")
    head = load(path, dtype="float32").draft_head
    tokens = torch.randint(0, hf_model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = hf_model(tokens[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed [n, D]
    return mtp, head, tokens, hidden


def _reference(mtp, tokens, hidden, positions):
    with torch.no_grad():
        return nextn_reference(mtp, tokens, hidden, positions)


def test_draft_steps_match_transformers(tiny_fixture):
    """Commits in chunks as the loop makes them, a first step per chunk (catch-up folded in) and one
    chained step on the head's own row, provisional rows dropped by keep: every logits row equals
    transformers' MTP layer over the pairs (h[j], t[j+1]) at position j+1 (+ the chained pair)."""
    mtp, head, tokens, hidden = _reference_and_head(tiny_fixture)
    assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
    assert head.draft_head_resumes_after_gap
    ref_logits, ref_hidden = _reference(mtp, tokens[1:], hidden[:-1], torch.arange(1, len(tokens)))
    state = head.new_state()
    head.draft_catch_up(state, tokens[:10].tolist(), hidden[:10], 0)
    pos = 10
    for kept in (3, 1, 5, 2, 4):
        logits, h_out = head.draft_step(state, int(tokens[pos]), hidden[pos - 1], pos)
        torch.testing.assert_close(logits, ref_logits[pos - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(h_out, ref_hidden[pos - 1], atol=ATOL, rtol=0)
        draft = int(logits.argmax())
        chained, _ = head.draft_step(state, draft, h_out, pos + 1)
        expected, _ = _reference(mtp, torch.cat([tokens[1:pos + 1], torch.tensor([draft])]),
                                 torch.cat([hidden[:pos], ref_hidden[pos - 1:pos]]), torch.arange(1, pos + 2))
        torch.testing.assert_close(chained, expected[-1], atol=ATOL, rtol=0)
        head.keep(state, kept)
        head.draft_catch_up(state, tokens[pos:pos + kept].tolist(), hidden[pos:pos + kept], pos)
        pos += kept


def test_head_restarts_after_a_gap(tiny_fixture):
    """Tokens committed without hidden rows (prefix reuse): the head's KV restarts at the next pair
    it can form, and steps equal the reference run over only those pairs."""
    mtp, head, tokens, hidden = _reference_and_head(tiny_fixture)
    state = head.new_state()
    head.draft_catch_up(state, tokens[:8].tolist(), hidden[:8], 0)
    head.draft_step(state, int(tokens[8]), hidden[7], 8)
    head.keep(state, 1)
    head.draft_catch_up(state, tokens[8:14].tolist(), None, 8)  # a gap: no hidden rows
    head.draft_catch_up(state, tokens[14:20].tolist(), hidden[14:20], 14)
    logits, _ = head.draft_step(state, int(tokens[20]), hidden[19], 20)
    expected, _ = _reference(mtp, tokens[15:21], hidden[14:20], torch.arange(15, 21))  # pairs j = 14..19
    torch.testing.assert_close(logits, expected[-1], atol=ATOL, rtol=0)


def test_own_embedding_and_head_are_read_when_the_file_has_them(tiny_fixture, tmp_path):
    """A NextN block with nextn.embed_tokens / nextn.shared_head_head (llama.cpp reads them when
    present): the head embeds and projects with those, not the trunk's."""
    hf_model, mtp, _ = tiny_fixture("nextn")
    n, v, d = hf_model.config.num_hidden_layers, hf_model.config.vocab_size, hf_model.config.hidden_size
    g = torch.Generator().manual_seed(5)
    embed, lm_head = 0.3 * torch.randn(v, d, generator=g), 0.3 * torch.randn(v, d, generator=g)
    path = write_fixture(hf_model, tmp_path / "own.gguf", mtp=mtp,
                         extra_tensors={f"blk.{n}.nextn.embed_tokens.weight": embed,
                                        f"blk.{n}.nextn.shared_head_head.weight": lm_head})
    trunk = load(path, dtype="float32", use_cache=False)
    assert trunk.config.nextn_has_embed_tokens and trunk.config.nextn_has_shared_head
    tokens = torch.tensor([3, 9, 27, 81, 100])
    hidden = torch.randn(5, d, generator=g)
    layer = mtp.layers[0]
    with torch.no_grad():
        x = layer.eh_proj(torch.cat([layer.enorm(embed[tokens]), layer.hnorm(hidden)], dim=-1))[None]
        cos_sin = mtp.rotary_emb(x, torch.arange(1, 6)[None])
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        out = layer.mtp_block(x, attention_mask=mask, position_embeddings=cos_sin)
        expected = layer.post_norm(out)[0, -1]
    state = trunk.draft_head.new_state()
    head = trunk.draft_head
    head.draft_catch_up(state, [0, *tokens[:4].tolist()], torch.cat([hidden[:4], hidden[4:]]), 0)
    logits, h_out = head.draft_step(state, int(tokens[4]), hidden[4], 5)
    torch.testing.assert_close(h_out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, expected @ lm_head.T, atol=ATOL, rtol=0)


def test_no_nextn_block_no_head(tiny_fixture):
    _, _, path = tiny_fixture("grouped")
    assert load(path, dtype="float32").draft_head is None


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_mtp_speculation_gives_the_plain_stream(tiny_fixture, dtype):
    speculator_mod = pytest.importorskip("verispec_mtp_nextn.speculator")
    from verispec.testing import run_greedy

    _, _, path = tiny_fixture("nextn")
    trunk = load(path, dtype=dtype)
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    plain = run_greedy(trunk, prompt, 48)[0]
    speculator = speculator_mod.MtpSpeculator(trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
    got, ex = run_greedy(trunk, prompt, 48, speculator, max_draft_tokens=4)
    assert got == plain
    assert ex.stats.num_draft_tokens > 0 and ex.stats.num_spec_steps > 0


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_one_speculator_serves_requests_in_turn(tiny_fixture, kind):
    """Two requests of one scheduler sharing one speculator (the NextN head's KV is per sequence),
    run alone in turn, each give their plain stream and the draft/accept counts they get alone."""
    from verispec.testing import run_greedy, run_greedy_requests

    if kind == "mtp":
        make = pytest.importorskip("verispec_mtp_nextn.speculator").MtpSpeculator
    else:
        make = pytest.importorskip("verispec_ngram.speculator").NGramSpeculator
    _, _, path = tiny_fixture("nextn")
    trunk = load(path, dtype="int8")

    def new():
        return make(trunk.draft_head, max_draft_tokens=3, min_draft_prob=0.0) if kind == "mtp" \
            else make(max_draft_tokens=3)

    prompts = [[1, 5, 9, 2, 7, 3, 11, 4] * 2, [8, 6, 10, 12, 40, 77, 101, 3, 8, 6]]
    plains = [run_greedy(trunk, p, 32)[0] for p in prompts]
    solos = [run_greedy(trunk, p, 32, new(), max_draft_tokens=3)[1].stats for p in prompts]
    runs = run_greedy_requests(trunk, prompts, 32, new(), max_running=1, max_draft_tokens=3)
    assert [tokens for tokens, _ in runs] == plains
    assert [ex.stats for _, ex in runs] == solos
