"""The per-token drafters' gate (--spec-pmin): drafting stops at the first draft step whose
confidence falls under `min_draft_prob`.

Confidence is the top-1 probability of a softmax over the step's GATE_TOP_K largest logits
(docs/design.md §5; llama.cpp's `--spec-draft-p-min` reads its drafter's top-k-filtered
distribution the same way): a full-vocabulary softmax would spread mass over ~10^5 tail tokens and shift the threshold with
the vocabulary size. Shared by every speculator that drafts one token per step (`mtp`,
`draft-model`, `gemma4-assistant`, `eagle3`); `greedy_chain` is the per-token heads' drafting
loop around it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the gate's softmax runs over this many largest logits (the `--spec-pmin` units, docs/design.md §5).
GATE_TOP_K = 10


def top1_gate_prob(logits: "torch.Tensor") -> float:
    """Top-1 probability, in [1/GATE_TOP_K, 1], of a softmax over the GATE_TOP_K largest of logits fp32 [V]."""
    import torch

    top = torch.topk(logits.float(), min(GATE_TOP_K, logits.numel())).values
    return float(torch.softmax(top, dim=0)[0])


def greedy_chain(step: Callable, ctx) -> list[int]:
    """A per-token head's greedy drafts for one step's DraftContext `ctx`: from (ctx.last_token,
    ctx.hidden_prev), `step(token, hidden, j) -> (logits fp32 [V], next hidden)` gives draft j's
    logits (j = 0, 1, ...); drafting stops under the gate, after a drafted stop token, and at
    ctx.max_draft_tokens. Empty without a hidden row or at a pending stop token."""
    if ctx.hidden_prev is None or ctx.last_token in ctx.stop_token_ids:
        return []
    draft: list[int] = []
    token, hidden = ctx.last_token, ctx.hidden_prev
    while len(draft) < ctx.max_draft_tokens:
        logits, hidden = step(token, hidden, len(draft))
        if top1_gate_prob(logits) < ctx.min_draft_prob:
            break
        token = int(logits.argmax())
        draft.append(token)
        if token in ctx.stop_token_ids:
            break
    return draft
