"""Paged attention in Triton: `ckernels.reference_attend`'s arithmetic (kernels.c's) on a GPU.

One call attends every row of every sequence through the sequences' block tables. Shapes:
q fp32 [rows, H, Dh]; the cache's blocks as two pools, K transposed fp32 [blocks, Hkv, Dh, B]
and V fp32 [blocks, Hkv, B, Dh]; tables int32 [sequences, max blocks] (slot t of sequence i in
block tables[i, t // B] at offset t % B); per row its sequence int32 [rows] and position
int64 [rows]; per sequence the slots it reads int32 [sequences]; slot_pos int64 [sequences,
max slots] (a slot's position; None: slot t holds position t) and a sliding window (0: none).

One program per (row, head); head h reads KV head h // (H / Hkv). Its arithmetic, each step one
IEEE fp32 operation (the launch passes enable_fp_fusion=False: no fused multiply-add on the GPU):
    s_t   = (((0 + q_0 k_0t) + q_1 k_1t) + ... + q_{Dh-1} k_{Dh-1,t}) · scaling   (d in order)
    m     = max of s_t over the visible slots
    e_t   = vexp(s_t - m) for a visible slot, else 0     (kernels.c's vexp, `triton_math.vexp`)
    den   = ((0 + e_0) + e_1) + ...,   o_d = ((0 + e_0 v_0d) + e_1 v_1d) + ...   (slots in order)
    out_d = o_d / den                                    (IEEE division: tl.div_rn)
A slot is visible to the row at position p when 0 <= its position sp <= p and, with a window
W > 0, p - sp < W. The keys are walked block by block in slot order whatever else the call
holds, with no split of a row's keys: a row's bits depend on its own query, its sequence's
cache and its position alone. (A masked slot adds 0, which leaves den and o bitwise as they
were, so reading slots a row cannot see changes nothing; with a window and slot t at position t,
the blocks wholly before the row's window are not read at all, so a sliding layer's work stays
W slots a row however long the sequence.)

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported: the tests' path); `triton_dispatch.use_triton` says which. A trunk
placed on a device (`TrunkModule.to_device`) calls it from `nn.attention.attend_rows` over its
`nn.kv_pool` pools.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["attend"]


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` and the helpers
    are module globals: a kernel finds what it calls through its globals."""
    global tl, _vexp, _scores
    import triton
    import triton.language as tl

    from verispec.kernels.triton_math import vexp

    _vexp = vexp()

    @triton.jit
    def _scores(q, k_ptr, block, head_kv, Hkv, slot_ok, scaling, D: tl.constexpr, B: tl.constexpr):
        """s [B] of one block's slots: q·k summed over d in order, then times scaling."""
        lanes = tl.arange(0, B)
        s = tl.zeros([B], dtype=tl.float32)
        base = k_ptr + (block * Hkv + head_kv) * D * B
        for d in range(0, D):
            qd = tl.sum(tl.where(tl.arange(0, D) == d, q, 0.0))  # q_d exactly (one term, the rest +0)
            s = s + qd * tl.load(base + d * B + lanes, mask=slot_ok, other=0.0)
        return s * scaling

    @triton.jit
    def attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, row_seq_ptr, pos_ptr, slots_ptr, slot_pos_ptr,
                      H, Hkv, max_blocks, max_slots, scaling, window,
                      D: tl.constexpr, B: tl.constexpr, HAS_SLOT_POS: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        head_kv = head // (H // Hkv)
        seq = tl.load(row_seq_ptr + row)
        p = tl.load(pos_ptr + row)
        num_slots = tl.load(slots_ptr + seq)
        dims = tl.arange(0, D)
        lanes = tl.arange(0, B)
        q = tl.load(q_ptr + (row * H + head) * D + dims)
        first = 0  # blocks wholly before a window hold no visible slot: skipped (they would add exact zeros)
        if not HAS_SLOT_POS:
            first = tl.where(window > 0, tl.maximum(p - window + 1, 0) // B, 0)
        m = -float("inf")
        for b in range(first, tl.cdiv(num_slots, B)):  # pass 1: the max over the visible slots
            t = b * B + lanes
            slot_ok = t < num_slots
            block = tl.load(tables_ptr + seq * max_blocks + b)
            sp = tl.load(slot_pos_ptr + seq * max_slots + t, mask=slot_ok, other=-1) if HAS_SLOT_POS else t
            vis = slot_ok & (sp >= 0) & (sp <= p) & ((window <= 0) | (p - sp < window))
            s = _scores(q, k_ptr, block, head_kv, Hkv, slot_ok, scaling, D, B)
            m = tl.maximum(m, tl.max(tl.where(vis, s, -float("inf"))))
        den = 0.0
        o = tl.zeros([D], dtype=tl.float32)
        for b in range(first, tl.cdiv(num_slots, B)):  # pass 2: the same scores, then e, den and o slot by slot
            t = b * B + lanes
            slot_ok = t < num_slots
            block = tl.load(tables_ptr + seq * max_blocks + b)
            sp = tl.load(slot_pos_ptr + seq * max_slots + t, mask=slot_ok, other=-1) if HAS_SLOT_POS else t
            vis = slot_ok & (sp >= 0) & (sp <= p) & ((window <= 0) | (p - sp < window))
            s = _scores(q, k_ptr, block, head_kv, Hkv, slot_ok, scaling, D, B)
            e = tl.where(vis, _vexp(tl.where(vis, s - m, 0.0)), 0.0)
            v_base = v_ptr + (block * Hkv + head_kv) * B * D
            for j in range(0, B):
                e_j = tl.sum(tl.where(lanes == j, e, 0.0))  # e_j exactly (one term, the rest +0)
                v = tl.load(v_base + j * D + dims, mask=b * B + j + dims * 0 < num_slots, other=0.0)
                den = den + e_j
                o = o + e_j * v
        tl.store(out_ptr + (row * H + head) * D + dims, tl.div_rn(o, tl.zeros([D], dtype=tl.float32) + den))

    return attend_kernel


def attend(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
           row_seq: torch.Tensor, positions: torch.Tensor, num_slots: torch.Tensor,
           slot_pos: torch.Tensor | None = None, *, scaling: float, window: int = 0) -> torch.Tensor:
    """Attention of every row (shapes, dtypes and arithmetic: the module docstring) -> fp32
    [rows, H, Dh] on q's device. Dh and the block size B must be powers of two (Triton's
    blocks). Raises ValueError for shapes that do not fit together."""
    rows, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block = k_blocks.shape
    if num_heads % num_kv_heads or v_blocks.shape != (k_blocks.shape[0], num_kv_heads, block, head_dim) \
            or k_blocks.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, K blocks {tuple(k_blocks.shape)} and V blocks "
                         f"{tuple(v_blocks.shape)} do not fit [rows, H, Dh], [blocks, Hkv, Dh, B], [blocks, Hkv, B, Dh]")
    if head_dim & (head_dim - 1) or block & (block - 1):
        raise ValueError(f"head dim {head_dim} and block size {block} must be powers of two for the Triton kernel")
    out = torch.empty_like(q)
    if rows == 0:
        return out
    max_slots = 0 if slot_pos is None else slot_pos.shape[1]
    _kernel()[(rows, num_heads)](
        q.contiguous(), k_blocks.contiguous(), v_blocks.contiguous(), out, tables.to(torch.int32).contiguous(),
        row_seq.to(torch.int32).contiguous(), positions.to(torch.int64).contiguous(),
        num_slots.to(torch.int32).contiguous(), positions if slot_pos is None else slot_pos.to(torch.int64).contiguous(),
        num_heads, num_kv_heads, tables.shape[1], max_slots, scaling, window,
        D=head_dim, B=block, HAS_SLOT_POS=slot_pos is not None, enable_fp_fusion=False)
    return out
