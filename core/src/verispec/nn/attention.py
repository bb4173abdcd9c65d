"""Causal / sliding-window grouped-query attention over a position-addressed KV cache.

`attend_rows` (every family's attention) runs the C kernel of `ckernels` when it is
available: all rows of all sequences of a forward in one call, each row's arithmetic fixed
by the kernel whatever else the call holds. Otherwise, and for an attention softcap, the
PyTorch path below runs; it is what the kernel replaces, and the tests hold the two within
fp32 rounding of each other.

PyTorch path:
Shape letters: n query rows, H query heads, Hkv KV heads, g = H / Hkv, Dh head dim,
T key slots read.

Batch invariance on CPU (docs/reference/cpu-kernel-facts.md): a row computed inside an n-row
verify must be bitwise the row computed alone. Two things make that true here:
1. Every product is one query row per bmm batch item ([g, Dh] @ [Dh, T], then
   [g, T] @ [T, Dh]); the kernels give the same bits whatever the batch count, whereas a
   [n·g, Dh] @ [Dh, T] gemm changes its blocking with n. n rows loop over the KV heads with
   the rows as the batch; one row (a decode) makes its KV heads the batch: one bmm pair.
   A batch of one item never runs: MKL takes another kernel for it (measured: bits differ
   for g = 5..11 query heads per KV head), so it runs as two identical items.
2. A row at position p reads exactly key_length(p) slots (`nn.state`), a function of p
   alone: padding a reduction with masked slots changes its summation order, so rows are
   grouped by key length and each group runs at its own T.
Masked slots (other positions, empty or stale ring slots) get -inf scores, hence weight
exactly 0, and contribute exact zeros to the output.
Softmax and everything else is fp32.
Source: transformers eager_attention_forward (scores · scaling, optional softcap, mask,
softmax, @ V); the sliding rule 0 <= q - k < window (docs/reference/gemma4.md §0, §3.1).
"""
from __future__ import annotations

import torch

from verispec.kernels import ckernels


def attend_rows(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, rows, layer: int, *,
                scaling: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention for a forward chunk of one or more sequences (`nn.trunk.Rows`).

    q: fp32 [n, H, Dh]; k, v: fp32 [n, Hkv, Dh], written into each sequence's cache of
    `layer` before it attends; None for a KV-shared layer, which reads what its source layer
    (`layer` is then the source's index) wrote in this forward. Returns fp32 [n, H, Dh].
    """
    caches = [s.state.layers[layer] for s in rows.sequences]
    if getattr(caches[0], "pool", None) is not None:  # a trunk on a device (nn.kv_pool): never the C kernels
        return _attend_pooled(q, k, v, caches, rows, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    if softcap is None and ckernels.library() is not None:
        return _attend_kernel(q, k, v, caches, rows, scaling=scaling, sliding_window=sliding_window)
    if k is not None:
        for s, cache in zip(rows.sequences, caches):
            cache.write(s.start_pos, k[s.begin:s.end], v[s.begin:s.end])
    outs = [attend(q[s.begin:s.end], cache, s.start_pos, scaling=scaling, sliding_window=sliding_window,
                   softcap=softcap, masks=s.masks)  # each sequence attends to its own cache only
            for s, cache in zip(rows.sequences, caches)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # one sequence (every plain decode, verify): no copy


def _attend_pooled(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, caches: list, rows, *,
                   scaling: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention over `nn.kv_pool` caches (a trunk on a device): the rows' K/V written into the
    pool, then every sequence's rows in one `kernels.triton_attend` call where
    `triton_dispatch.use_triton(q)`, else the PyTorch path per sequence. q fp32 [n, H, Dh] ->
    fp32 [n, H, Dh] on q's device."""
    from verispec.kernels import triton_dispatch

    if k is not None:
        for s, cache in zip(rows.sequences, caches):
            cache.write(s.start_pos, k[s.begin:s.end], v[s.begin:s.end])
    if softcap is not None or not triton_dispatch.use_triton(q):
        outs = [attend(q[s.begin:s.end], cache, s.start_pos, scaling=scaling, sliding_window=sliding_window,
                       softcap=softcap, masks=s.masks) for s, cache in zip(rows.sequences, caches)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    from verispec.kernels import triton_attend

    row_seq, num_slots = _pooled_rows(caches, rows)
    if len(caches) == 1:
        tables = caches[0].table()[None]  # [1, blocks]
    else:
        width = max(len(c.ids) for c in caches)
        tables = torch.stack([torch.nn.functional.pad(c.table(), (0, width - len(c.ids))) for c in caches])
    pool = caches[0].pool
    return triton_attend.attend(q.contiguous(), pool.k, pool.v, tables, row_seq, rows.positions, num_slots,
                                scaling=scaling, window=sliding_window or 0)


def _pooled_rows(caches: list, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's sequence int32 [n], each sequence's slots read int32 [sequences]) on the rows'
    device, built once per forward (memoised in the first sequence's `masks`: every layer of a
    forward asks, with caches of one key block)."""
    memo = rows.sequences[0].masks
    key = ("pooled rows", caches[0].key_block)
    if key not in memo:
        counts = [s.end - s.begin for s in rows.sequences]
        row_seq = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts))
        num_slots = torch.tensor([c.key_length(s.start_pos + s.end - s.begin - 1)
                                  for s, c in zip(rows.sequences, caches)], dtype=torch.int32)
        memo[key] = (row_seq.to(rows.positions.device), num_slots.to(rows.positions.device))
    return memo[key]


def _attend_kernel(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, caches: list, rows, *,
                   scaling: float, sliding_window: int | None) -> torch.Tensor:
    """Every sequence's rows in one kernel call, which writes k, v first; q fp32 [n, H, Dh] ->
    fp32 [n, H, Dh]."""
    desc, work = kernel_descriptors(caches, rows, write=k is not None, sliding_window=sliding_window)
    q = q.contiguous()
    out = torch.empty_like(q)
    if k is not None:
        k, v = k.contiguous(), v.contiguous()
    ckernels.attend(q, k, v, out, desc, caches[0].num_kv_heads, scaling, work=work * q.shape[1])
    return out


def kernel_descriptors(caches: list, rows, *, write: bool, sliding_window: int | None = None
                       ) -> tuple[torch.Tensor, int]:
    """The attention kernel's descriptors for a forward's sequences (`ckernels.attend`): int64
    [sequences, 9], and the rows x slots it reads. write: the rows' K/V are about to be written
    (each cache's `prepare_write` is done here). The caches hold the block tables the
    descriptors point into."""
    desc, work = descriptor_rows(caches, rows, write=write, sliding_window=sliding_window)
    return torch.tensor(desc, dtype=torch.int64), work


def descriptor_rows(caches: list, rows, *, write: bool, sliding_window: int | None = None
                    ) -> tuple[list[tuple], int]:
    """`kernel_descriptors` as a list of 9-tuples, one per sequence (to be stacked with other
    layers' into one tensor), and the rows x slots read."""
    desc, work = [], 0
    for s, cache in zip(rows.sequences, caches):
        n = s.end - s.begin
        if write:
            cache.prepare_write(s.start_pos, n)
        k_table, v_table, block, slot_pos = cache.kernel_view()
        num_slots = cache.key_length(s.start_pos + n - 1)
        desc.append((s.begin, n, s.start_pos, num_slots, block, k_table.data_ptr(), v_table.data_ptr(),
                     0 if slot_pos is None else slot_pos.data_ptr(), sliding_window or 0))  # ckernels.attend
        work += n * num_slots
    return desc, work


def attend(q: torch.Tensor, cache, start_pos: int, *, scaling: float, sliding_window: int | None = None,
           softcap: float | None = None, masks: dict | None = None) -> torch.Tensor:
    """Attention of n new rows at positions start_pos .. start_pos + n - 1.

    q: fp32 [n, H, Dh] (already normed/roped). cache: an `nn.state` KV cache that already
    holds these rows' K/V. masks: a dict the layers of one forward of this sequence share
    (`RowsOfSequence.masks`), so the visibility mask is built once per forward, not per
    layer; None builds it here. Returns fp32 [n, H, Dh].
    """
    n = q.shape[0]
    num_slots = cache.key_length(start_pos)
    if cache.key_length(start_pos + n - 1) == num_slots:  # key_length never falls with position, so
        # every row reads num_slots: every decode, most verifies (no grouping, no output copy)
        return _attend_group(q, cache, start_pos, num_slots, scaling=scaling, sliding_window=sliding_window,
                             softcap=softcap, masks=masks)
    groups = []  # (first row, end row, key length): rows sharing a key length form one group
    for row in range(n):
        num_slots = cache.key_length(start_pos + row)
        if groups and groups[-1][2] == num_slots:
            groups[-1][1] = row + 1
        else:
            groups.append([row, row + 1, num_slots])
    out = torch.empty_like(q)
    for row, end, num_slots in groups:
        out[row:end] = _attend_group(q[row:end], cache, start_pos + row, num_slots, scaling=scaling,
                                     sliding_window=sliding_window, softcap=softcap, masks=masks)
    return out


def _attend_group(q: torch.Tensor, cache, start_pos: int, num_slots: int, *, scaling: float,
                  sliding_window: int | None, softcap: float | None, masks: dict | None) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    k, v, slot_pos = cache.read(num_slots)  # [Hkv, T, Dh], [Hkv, T, Dh], [T]
    k = k.contiguous()  # the caches hold keys transposed (the kernel's layout); MKL's bmm is batch-
    # invariant (measured) with keys as transposed views of [T, Dh] rows, so lay them out that way
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    mask_bias = _mask_bias(cache, slot_pos, start_pos, n, sliding_window, masks)  # [n, 1, T]
    if n == 1:  # one row: its KV heads are the bmm batch, still one query row per item
        out = _attend_heads(q.view(num_kv_heads, group, head_dim), k.transpose(1, 2), v, mask_bias,
                            scaling=scaling, softcap=softcap)  # [Hkv, g, Dh]
        return out.view(1, num_heads, head_dim)
    q = q.view(n, num_kv_heads, group, head_dim)
    out = [_attend_heads(q[:, j], k[j].t().expand(n, head_dim, num_slots),  # keys [n, Dh, T], no copy
                         v[j].expand(n, num_slots, head_dim), mask_bias, scaling=scaling, softcap=softcap)
           for j in range(num_kv_heads)]  # Hkv x [n, g, Dh]
    return torch.stack(out, dim=1).view(n, num_heads, head_dim)


def _mask_bias(cache, slot_pos: torch.Tensor, start_pos: int, n: int, sliding_window: int | None,
               masks: dict | None) -> torch.Tensor:
    """fp32 [n, 1, T]: -inf where query row i (at start_pos + i) must not see slot t, else 0.
    Memoised in `masks` under the cache's `mask_key`: caches with equal keys hold equal slot
    positions."""
    if masks is None:
        return _build_mask_bias(slot_pos, start_pos, n, sliding_window)
    key = (cache.mask_key, start_pos, n, slot_pos.shape[0], sliding_window)
    if key not in masks:
        masks[key] = _build_mask_bias(slot_pos, start_pos, n, sliding_window)
    return masks[key]


def _build_mask_bias(slot_pos: torch.Tensor, start_pos: int, n: int, sliding_window: int | None) -> torch.Tensor:
    q_pos = torch.arange(start_pos, start_pos + n, device=slot_pos.device)[:, None]  # [n, 1]
    visible = (slot_pos >= 0) & (slot_pos <= q_pos)  # [n, T]
    if sliding_window is not None:
        visible &= q_pos - slot_pos < sliding_window
    return torch.zeros(n, 1, slot_pos.shape[0], device=slot_pos.device).masked_fill_(~visible[:, None, :], float("-inf"))


def _attend_heads(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask_bias: torch.Tensor, *,
                  scaling: float, softcap: float | None) -> torch.Tensor:
    """softmax(q·keys · scaling + mask_bias) · values per bmm item: q [b, g, Dh], keys [b, Dh, T],
    values [b, T, Dh], mask_bias fp32 0 / -inf [b or 1, 1, T] -> [b, g, Dh]. Each item is one
    query row. Adding 0 or -inf is bitwise masked_fill; baddbmm's alpha is bitwise bmm then
    multiply (measured), in one kernel call."""
    single = q.shape[0] == 1
    if single:  # a bmm batch of one takes another kernel whose bits differ (g = 5..11 here): run two
        q, keys, values = q.expand(2, -1, -1), keys.expand(2, -1, -1), values.expand(2, -1, -1)
    if softcap is None:
        scores = torch.baddbmm(mask_bias, q, keys, alpha=scaling)  # [b, g, T]
    else:  # the mask goes after the cap: tanh would turn -inf into -softcap
        scores = torch.bmm(q, keys).mul_(scaling).div_(softcap).tanh_().mul_(softcap).add_(mask_bias)
    out = torch.bmm(torch.softmax(scores, dim=-1), values)
    return out[:1] if single else out
