"""fp32 parity with transformers: tiny random nemotron_h (dense) and nemotron_h_moe -> GGUF -> our loader.

transformers 5.24's NemotronHForCausalLM runs Mamba-2 prefill through its chunked SSD scan
(chunk_size 16 here, so 64 rows cross four chunks) and decode through its one-row step; we run
the recurrence row by row for both. Logits of every prefill row, then one-row decodes after
it, a prefill split into several forward chunks, a multi-row continuation on a cached prefix,
and the final-normed hidden rows.
"""
import pytest
import torch
from verispec.seams import Segment
from verispec.testing import forward_one
from verispec_nemotron.loader import load

pytest.importorskip("transformers")

ATOL = 1e-4  # docs/design.md §6: fp32 max |Δlogit| on tiny random configs
NUM_PROMPT, NUM_DECODE = 64, 16


def _prompt_and_continuation(vocab_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (NUM_PROMPT,), generator=g).tolist(),
            torch.randint(0, vocab_size, (NUM_DECODE,), generator=g).tolist())


def _hf_logits(hf_model, pieces):
    """HF logits fp32 [n_i, V] for each piece of tokens fed in turn through one cache."""
    cache, out = None, []
    with torch.no_grad():
        for piece in pieces:
            result = hf_model(torch.tensor([piece]), cache=cache, use_cache=True)
            cache = result.cache
            out.append(result.logits[0])
    return out


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_prefill_and_decode_logits_match_transformers(tiny_fixture, name):
    hf_model, path = tiny_fixture(name)
    ours = load(path, dtype="float32", use_cache=False, tokenizer=False)
    prompt, continuation = _prompt_and_continuation(hf_model.config.vocab_size)
    expected_prefill, *expected_decodes = _hf_logits(hf_model, [prompt] + [[t] for t in continuation])

    seq = ours.new_sequence()
    prefill = forward_one(ours, seq, prompt).logits
    decodes = torch.cat([forward_one(ours, seq, [t], logits="last").logits for t in continuation])
    assert ours.seq_len(seq) == NUM_PROMPT + NUM_DECODE
    assert ours.vocab_size == hf_model.config.vocab_size
    hf_names = {"linear_attention": "mamba", "full_attention": "attention"}
    assert ours.config.layer_types == tuple(hf_names.get(t, t) for t in hf_model.config.layers_block_type)
    torch.testing.assert_close(prefill, expected_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(decodes, torch.cat(expected_decodes), atol=ATOL, rtol=0)


def test_chunked_prefill_and_a_cached_multi_row_continuation_match_transformers(tiny_fixture):
    """Our prefill in 7-row forward chunks, then 9 rows at once on the cached prefix (HF's
    cached multi-token forward: its chunked scan from the cached state)."""
    hf_model, path = tiny_fixture("moe")
    ours = load(path, dtype="float32", use_cache=False, tokenizer=False, max_rows_per_forward=7)
    prompt, continuation = _prompt_and_continuation(hf_model.config.vocab_size, seed=2)
    expected_prefill, expected_rows = _hf_logits(hf_model, [prompt, continuation[:9]])
    seq = ours.new_sequence()
    torch.testing.assert_close(forward_one(ours, seq, prompt).logits, expected_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(forward_one(ours, seq, continuation[:9], verify=True).logits, expected_rows,
                               atol=ATOL, rtol=0)


def test_hidden_taps_match_transformers_hidden_states(tiny_fixture):
    """Residuals entering each layer are HF's hidden_states[i]; the final-normed rows are its
    last entry (HF replaces the last block's output by norm_f's)."""
    hf_model, path = tiny_fixture("dense")
    ours = load(path, dtype="float32", use_cache=False, tokenizer=False)
    prompt = [5, 9, 17, 33, 2, 64, 101, 7]
    with torch.no_grad():
        states = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    layers = tuple(range(ours.num_layers))
    seq_taps, seq_normed = ours.new_sequence(), ours.new_sequence()
    taps, normed = ours.forward([Segment(seq_taps, prompt, logits="none", hidden=True, tap_layers=layers),
                                 Segment(seq_normed, prompt, logits="last", hidden=True)])
    expected = torch.cat([states[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(taps.hidden, expected, atol=ATOL, rtol=0)
    assert normed.logits.shape == (1, hf_model.config.vocab_size)
    torch.testing.assert_close(normed.hidden, states[-1][0], atol=ATOL, rtol=0)
