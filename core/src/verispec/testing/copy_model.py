"""A transformers causal LM rebuilt to continue one token forever: the trunk of a perfect-drafter test.

`make_copy_model(model, token)` zeroes every sublayer's output projection (attention `o_proj`, MLP
`down_proj`), so the layers write nothing to the residual, and redraws the embedding rows around one
direction e0 (token `token`'s row 3·e0, the others e0 plus small noise). Whatever the prompt, the
final norm sees a multiple of e0, and an untied LM head whose `token` row is e0/|e0| (the others
small noise) scores `token` first: greedy decoding continues `token` forever. A drafter built to
draft `token` from such a trunk's taps is then accepted in full, while every pass of the real code
(taps, caches, keep/commit) still runs. Degenerate weights, on purpose.
"""
from __future__ import annotations

import torch

__all__ = ["make_copy_model"]


def make_copy_model(model, token: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rebuild the transformers causal LM `model` in place as the module docstring says; returns e0
    (fp32 [D]), which a test uses to point its drafter at `token`. A tied head is the embedding,
    already right; the final norm gets unit gain (weight 1, or 0 where Gemma's norm computes 1 + w).
    The draws come from `generator` (default: a new one seeded 11), which the caller may go on using."""
    g = torch.Generator().manual_seed(11) if generator is None else generator
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb = model.model.embed_tokens.weight
        e0 = torch.randn(emb.shape[1], generator=g)
        emb.copy_(e0 + 0.01 * torch.randn(emb.shape, generator=g))
        emb[token] = 3 * e0
        if getattr(model.config, "tie_word_embeddings", False) is False:
            model.lm_head.weight.copy_(0.01 * torch.randn(model.lm_head.weight.shape, generator=g))
            model.lm_head.weight[token] = e0 / e0.norm()
        if hasattr(model.model, "norm"):
            model.model.norm.weight.fill_(0.0 if model.config.model_type.startswith("gemma") else 1.0)
    return e0
