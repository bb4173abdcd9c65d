"""fp32 parity with transformers: tiny random glm_moe_dsa -> GGUF -> our loader.

Covers MLA (q and kv LoRA, per-head k_b / v_b from llama.cpp's split, interleaved RoPE on 8 of
20 q·k dims), the DSA indexer with index_topk below the context (rows past it attend to a
strict subset of keys), a shared-indexer layer (GLM-5.2's types array) and all-full layers (no
types key: the context-length switch), dense leading layers, sigmoid-routed MoE with expert
groups, tied and untied heads. An 80-row prefill in one chunk (the unabsorbed form; the default
chunk of 64 rows never reaches it), 16 one-row decodes (the absorbed form), and the prefill
again in 8-row chunks (absorbed), which must also be within fp32 rounding of the one-chunk rows.

Tolerance: max |Δlogit| <= 1e-4 (logits up to ~9; measured <= 2e-5).
"""
import pytest
import torch
from verispec.testing import forward_one
from verispec.testing.hf_parity import hf_prefill_and_decodes, random_tokens
from verispec_glm5.loader_glm_dsa import load
from verispec_glm5.mla import UNABSORBED_MIN_ROWS, MlaAttention

pytest.importorskip("transformers")

ATOL = 1e-4
PROMPT, DECODES = 80, 16


def _tokens(vocab):
    return random_tokens(vocab, PROMPT, DECODES)


@pytest.mark.parametrize("name", ["shared", "full"])
def test_prefill_and_decode_logits_match_transformers(tiny_dsa_fixture, name, monkeypatch):
    hf_model, _, path = tiny_dsa_fixture(name)
    ours = load(path, dtype="float32", max_rows_per_forward=128)  # the 80-row prompt in one chunk
    assert ours.config.index_topk < PROMPT and PROMPT >= UNABSORBED_MIN_ROWS
    assert ours.config.indexer_full == tuple(t == "full" for t in hf_model.config.indexer_types)
    prompt, continuation = _tokens(hf_model.config.vocab_size)
    expected_prefill, expected_decodes = hf_prefill_and_decodes(hf_model, prompt, continuation)

    unabsorbed_rows = []
    original = MlaAttention._unabsorbed
    monkeypatch.setattr(MlaAttention, "_unabsorbed",
                        lambda self, q_nope, *a: unabsorbed_rows.append(len(q_nope)) or original(self, q_nope, *a))
    seq = ours.new_sequence()
    prefill = forward_one(ours, seq, prompt).logits
    assert unabsorbed_rows == [PROMPT] * ours.num_layers  # then only the absorbed form
    decodes = torch.cat([forward_one(ours, seq, [t], logits="last").logits for t in continuation])
    chunked = ours.new_sequence()
    absorbed = torch.cat([forward_one(ours, chunked, prompt[i:i + 8]).logits for i in range(0, PROMPT, 8)])
    assert len(unabsorbed_rows) == ours.num_layers
    assert expected_prefill.abs().max() > 5  # sharp logits: parity is not trivially small numbers
    torch.testing.assert_close(prefill, expected_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(decodes, expected_decodes, atol=ATOL, rtol=0)
    torch.testing.assert_close(absorbed, expected_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(absorbed, prefill, atol=2e-5, rtol=0)


def test_the_indexer_selection_changes_the_logits(tiny_dsa_fixture, tmp_path):
    """The same weights with top_k above the context (dense attention) give logits far from
    transformers' sparse ones past row index_topk, equal before it: the selection is exercised."""
    import tiny_glm_dsa

    hf_model, mtp, _ = tiny_dsa_fixture("shared")
    dense = load(tiny_glm_dsa.write_fixture(hf_model, tmp_path / "dense.gguf", mtp=mtp,
                                            extra_metadata={"glm-dsa.attention.indexer.top_k": 512}),
                 dtype="float32")
    prompt, _ = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = forward_one(dense, dense.new_sequence(), prompt).logits
    k = hf_model.config.index_topk
    torch.testing.assert_close(got[:k], expected[:k], atol=ATOL, rtol=0)
    assert (got[k:] - expected[k:]).abs().max() > 0.1


def test_selection_restricts_rows_past_top_k(tiny_dsa_fixture):
    """Each row's allowed keys: every earlier position up to index_topk visible keys, then exactly
    index_topk of them, never a later one; the absorbed (one row at a time) and unabsorbed
    (whole chunk) selections agree."""
    hf_model, _, path = tiny_dsa_fixture("full")
    ours = load(path, dtype="float32")
    indexer = ours.model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(5)
    n, k = 40, indexer.top_k
    q = torch.randn(n, indexer.num_heads, indexer.head_dim, generator=g)
    w = torch.randn(n, indexer.num_heads, generator=g)
    keys = torch.randn(n, indexer.head_dim, generator=g)
    rowwise = indexer.select(q, w, keys, 0, rowwise=True)
    whole = indexer.select(q, w, keys, 0, rowwise=False)
    assert torch.equal(rowwise, whole)
    counts = rowwise.sum(dim=1)
    assert counts.tolist() == [min(i + 1, k) for i in range(n)]
    assert not torch.triu(rowwise, diagonal=1).any()
