"""RMSNorm in Triton: `ckernels.reference_rms_norm`'s arithmetic (kernels.c's) on a GPU.

x fp32 [rows, dim] -> fp32 [rows, dim], times weight fp32 [dim] where given. One program per
row; its arithmetic, each step one IEEE fp32 operation (the launch passes enable_fp_fusion=False:
no fused multiply-add on the GPU):
    lanes_j = ((0 + x_j²) + x_{16+j}²) + ...     16 lanes, chunks in order, the tail chunk zero-padded
    lanes_j = lanes_j + lanes_{j+h}               for h = 8, 4, 2, 1 (then lanes_0 is the sum)
    mean    = lanes_0 / dim + eps                 (IEEE division: tl.div_rn)
    inv     = 1 / sqrt(mean)                      (correctly rounded: tl.sqrt_rn, tl.div_rn)
    out_i   = (x_i · inv) · w_i
The halvings reshape the lanes [2h] to [2, h] and sum its first axis: element j of the sum is
lanes_j + lanes_{j+h}, one addition (a sum of two values has one order). A row's bits depend on
the row alone: not on the other rows or the grid.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported: the tests' path); `triton_dispatch.use_triton` says which. A trunk
placed on a device (`TrunkModule.to_device`) calls it from `nn.norm.RMSNorm`.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["rms_norm"]


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` is made a
    module global: the interpreter patches the language module through the kernel's globals."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, DIM: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_WEIGHT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * DIM
        lane = tl.arange(0, 16)
        lanes = tl.zeros([16], dtype=tl.float32)
        for c in tl.range(0, (DIM + 15) // 16, loop_unroll_factor=8):  # the 16-wide chunks in order; past dim: zeros
            v = tl.load(x_row + c * 16 + lane, mask=c * 16 + lane < DIM, other=0.0)
            lanes = lanes + v * v
        lanes = tl.sum(tl.reshape(lanes, (2, 8)), axis=0)  # [8]: lanes_j + lanes_{j+8}
        lanes = tl.sum(tl.reshape(lanes, (2, 4)), axis=0)
        lanes = tl.sum(tl.reshape(lanes, (2, 2)), axis=0)
        total = tl.sum(lanes, axis=0)  # lanes_0 + lanes_1
        mean = tl.div_rn(total, tl.full([], DIM, tl.float32)) + eps
        inv = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean))
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, DIM, BLOCK):
            ok = c0 + cols < DIM
            out = tl.load(x_row + c0 + cols, mask=ok, other=0.0) * inv
            if HAS_WEIGHT:
                out = out * tl.load(w_ptr + c0 + cols, mask=ok, other=0.0)
            tl.store(out_ptr + row * DIM + c0 + cols, out, mask=ok)

    return rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference_rms_norm`'s bits on x's device (CUDA, or CPU under TRITON_INTERPRET=1): x fp32
    [rows, dim], weight fp32 [dim] or None -> fp32 [rows, dim]. The kernel is compiled per dim (a
    model has two or three: the hidden size, the head dim). Raises ValueError for a weight that is
    not [dim]."""
    import triton

    rows, dim = x.shape
    if weight is not None and weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}: it must be [{dim}]")
    x = x.float().contiguous()
    out = torch.empty_like(x)
    if rows == 0 or dim == 0:
        return out
    w = x if weight is None else weight.float().contiguous()  # x: an unread pointer
    _kernel()[(rows,)](x, w, out, eps, DIM=dim, BLOCK=min(triton.next_power_of_2(dim), 1024),
                       HAS_WEIGHT=weight is not None, enable_fp_fusion=False)
    return out
