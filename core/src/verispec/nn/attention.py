"""Causal / sliding-window grouped-query attention over a position-addressed KV cache.

Shape letters: n query rows, H query heads, Hkv KV heads, g = H / Hkv, Dh head dim,
T key slots read.

Batch invariance on CPU (reference/cpu-kernel-facts.md): a row computed inside an n-row
verify must be bitwise the row computed alone. Two things make that true here:
1. Every product is one query row per bmm batch item ([g, Dh] @ [Dh, T], then
   [g, T] @ [T, Dh]); the kernels give the same bits whatever the batch count, whereas a
   [n·g, Dh] @ [Dh, T] gemm changes its blocking with n.
2. A row at position p reads exactly key_length(p) slots (`nn.state`), a function of p
   alone: padding a reduction with masked slots changes its summation order, so rows are
   grouped by key length and each group runs at its own T.
Masked slots (other positions, empty or stale ring slots) get -inf scores, hence weight
exactly 0, and contribute exact zeros to the output.
Softmax and everything else is fp32.
Source: transformers eager_attention_forward (scores · scaling, optional softcap, mask,
softmax, @ V); the sliding rule 0 <= q - k < window (reference/gemma4.md §0, §3.1).
"""
from __future__ import annotations

import torch


def attend_rows(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, rows, layer: int, *,
                scaling: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention for a forward chunk of one or more sequences (`nn.trunk.Rows`).

    q: fp32 [n, H, Dh]; k, v: fp32 [n, Hkv, Dh], written into each sequence's cache of
    `layer` before it attends; None for a KV-shared layer, which reads what its source layer
    (`layer` is then the source's index) wrote in this forward. Returns fp32 [n, H, Dh].
    """
    out = None if len(rows.sequences) == 1 else torch.empty_like(q)
    for s in rows.sequences:  # each sequence attends to its own cache only
        cache = s.state.layers[layer]
        if k is not None:
            cache.write(s.start_pos, k[s.rows], v[s.rows])
        rows_out = attend(q[s.rows], cache, s.start_pos, scaling=scaling, sliding_window=sliding_window,
                          softcap=softcap)
        if out is None:  # one sequence (every plain decode and verify): no copy
            return rows_out
        out[s.rows] = rows_out
    return out


def attend(q: torch.Tensor, cache, start_pos: int, *, scaling: float, sliding_window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Attention of n new rows at positions start_pos .. start_pos + n - 1.

    q: fp32 [n, H, Dh] (already normed/roped). cache: an `nn.state` KV cache that already
    holds these rows' K/V. Returns fp32 [n, H, Dh].
    """
    n = q.shape[0]
    out = torch.empty_like(q)
    row = 0
    while row < n:  # rows sharing a key length form one group (at most 2 when n <= key_block)
        num_slots = cache.key_length(start_pos + row)
        end = row + 1
        while end < n and cache.key_length(start_pos + end) == num_slots:
            end += 1
        out[row:end] = _attend_group(q[row:end], cache, start_pos + row, num_slots,
                                     scaling=scaling, sliding_window=sliding_window, softcap=softcap)
        row = end
    return out


def _attend_group(q: torch.Tensor, cache, start_pos: int, num_slots: int, *, scaling: float,
                  sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    k, v, slot_pos = cache.read(num_slots)  # [Hkv, T, Dh], [Hkv, T, Dh], [T]
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    q_pos = torch.arange(start_pos, start_pos + n)[:, None]  # [n, 1]
    visible = (slot_pos[None, :] >= 0) & (slot_pos[None, :] <= q_pos)  # [n, T]
    if sliding_window is not None:
        visible &= q_pos - slot_pos[None, :] < sliding_window
    hidden = ~visible[:, None, :]  # [n, 1, T]
    q = q.view(n, num_kv_heads, group, head_dim)
    out = torch.empty(n, num_kv_heads, group, head_dim)
    for j in range(num_kv_heads):
        keys = k[j].t().expand(n, head_dim, num_slots)  # [n, Dh, T], no copy
        scores = torch.bmm(q[:, j], keys) * scaling  # [n, g, T]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, j] = torch.bmm(probs, v[j].expand(n, num_slots, head_dim))  # [n, g, Dh]
    return out.view(n, num_heads, head_dim)
