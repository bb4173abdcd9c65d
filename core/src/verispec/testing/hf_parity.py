"""fp32 parity with a transformers model, as the families' parity tests check it.

- `random_tokens`: seeded random token ids, a prompt and a continuation.
- `hf_prefill_and_decodes`: transformers' logits of a prompt in one forward, then of one-token
  decodes on its cache (the reference).
- `assert_logits_match_transformers`: our trunk's prefill and one-row decodes equal them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["assert_logits_match_transformers", "hf_prefill_and_decodes", "random_tokens"]


def random_tokens(vocab_size: int, *lengths: int, seed: int = 1) -> list[list[int]]:
    """One list of random ids in [0, vocab_size) per length, drawn in turn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_prefill_and_decodes(hf_model, prompt: Sequence[int], continuation: Sequence[int]):
    """transformers' logits fp32 [len(prompt), V] of the prompt, then [len(continuation), V] of
    one-token decodes on its cache (`hf_model(input_ids, cache=..., use_cache=True).logits`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        prefill = hf_model(torch.tensor([list(prompt)]), cache=cache, use_cache=True).logits[0]
        decodes = [hf_model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0] for t in continuation]
    return prefill, torch.cat(decodes)


def assert_logits_match_transformers(trunk, hf_model, prompt: Sequence[int], continuation: Sequence[int], *,
                                     atol: float = 1e-4) -> None:
    """Our logits of `prompt` as one prefill, then of `continuation` as one-row decodes, equal
    transformers' (`hf_prefill_and_decodes`) within `atol`; the reference's logits are sharp (some
    above 5), so parity is not trivially small numbers."""
    from verispec.testing import forward_one

    expected_prefill, expected_decodes = hf_prefill_and_decodes(hf_model, prompt, continuation)
    seq = trunk.new_sequence()
    prefill = forward_one(trunk, seq, prompt).logits
    decodes = torch.cat([forward_one(trunk, seq, [t], logits="last").logits for t in continuation])
    assert trunk.seq_len(seq) == len(prompt) + len(continuation) and trunk.vocab_size == hf_model.config.vocab_size
    trunk.release(seq)
    assert expected_prefill.abs().max() > 5
    torch.testing.assert_close(prefill, expected_prefill, atol=atol, rtol=0)
    torch.testing.assert_close(decodes, expected_decodes, atol=atol, rtol=0)
