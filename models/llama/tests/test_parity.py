"""fp32 parity with transformers: tiny random llama / qwen2 -> GGUF -> our loader.

Covers llama's permuted Q/K with interleaved RoPE, qwen2's neox RoPE with QKV biases, tied
and untied heads, o_proj bias, llama3 `rope_freqs` and linear RoPE scaling; logits of every
prefill row, then one-row decodes after it, and a prefill split into several chunks.
"""
import pytest
import torch
from verispec.testing import forward_one
from verispec_llama.loader import load

pytest.importorskip("transformers")

PARITY_CONFIGS = ["llama", "llama_tied_bias_llama3", "qwen2", "qwen2_tied_linear"]
ATOL = 1e-4  # docs/design.md §6: fp32 max |Δlogit| on tiny random configs


def _hf_prefill_and_decodes(hf_model, prompt, continuation):
    """HF logits fp32 [len(prompt), V] for the prompt, then [1, V] per continuation token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        prefill = hf_model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]
        decodes = [hf_model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0] for token in continuation]
    return prefill, decodes and torch.cat(decodes)


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_prefill_and_decode_logits_match_transformers(tiny_fixture, name):
    hf_model, path = tiny_fixture(name)
    ours = load(path, dtype="float32")
    g = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompt = torch.randint(0, vocab, (23,), generator=g).tolist()
    continuation = torch.randint(0, vocab, (6,), generator=g).tolist()
    expected_prefill, expected_decodes = _hf_prefill_and_decodes(hf_model, prompt, continuation)

    seq = ours.new_sequence()
    prefill = forward_one(ours, seq, prompt).logits
    decodes = torch.cat([forward_one(ours, seq, [t], logits="last").logits for t in continuation])
    assert ours.seq_len(seq) == len(prompt) + len(continuation)

    assert ours.vocab_size == vocab
    torch.testing.assert_close(prefill, expected_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(decodes, expected_decodes, atol=ATOL, rtol=0)


def test_prefill_split_into_chunks_matches_transformers(tiny_fixture):
    hf_model, path = tiny_fixture("qwen2")
    ours = load(path, dtype="float32")
    ours.max_rows_per_forward = 7  # 40 rows -> chunks of 7, 7, 7, 7, 7, 5
    prompt = torch.randint(0, hf_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    expected, _ = _hf_prefill_and_decodes(hf_model, prompt, [])
    got = forward_one(ours, ours.new_sequence(), prompt).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_hidden_rows_are_the_final_normed_residual(tiny_fixture):
    hf_model, path = tiny_fixture("llama")
    ours = load(path, dtype="float32")
    prompt = [5, 9, 17, 33, 2, 64]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    out = forward_one(ours, ours.new_sequence(), prompt, logits="last", hidden=True)
    assert out.logits.shape == (1, hf_model.config.vocab_size)
    torch.testing.assert_close(out.hidden, expected, atol=ATOL, rtol=0)  # HF's last hidden state is normed
