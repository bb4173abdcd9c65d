"""A row's dot product in Triton, in the RMSNorm kernels' fixed order: `ckernels.lane_dot`'s bits.

x fp32 [rows, dim], y fp32 [rows, dim] or [dim] (the same for every row) -> fp32 [rows, 1], each
row's Σ x_i·y_i. One program per row; each step one IEEE fp32 operation (the launch passes
enable_fp_fusion=False: no fused multiply-add on the GPU):
    lanes_j = ((0 + x_j·y_j) + x_{16+j}·y_{16+j}) + ...   16 lanes, chunks in order, the tail zero-padded
    lanes_j = lanes_j + lanes_{j+h}                        for h = 8, 4, 2, 1 (then lanes_0 is the sum)
(`triton_norm`'s sum of squares, with y for the second x). A row's bits depend on the row alone,
never on the other rows or the grid: a sum a placed trunk needs where torch's GPU reductions
would pick their order by shape (Qwen 3.5's q/k l2norm, its MoE router and shared-expert gate).

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported: the tests' path); `triton_dispatch.use_triton` says which. A placed
Qwen 3.5 trunk calls it from its GDN layers and MoE router.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["lane_dot"]


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` is made a
    module global: the interpreter patches the language module through the kernel's globals."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def lane_dot_kernel(x_ptr, y_ptr, out_ptr, y_row_stride, DIM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, 16)
        lanes = tl.zeros([16], dtype=tl.float32)
        for c in tl.range(0, (DIM + 15) // 16, loop_unroll_factor=8):  # the 16-wide chunks in order; past dim: zeros
            ok = c * 16 + lane < DIM
            a = tl.load(x_ptr + row * DIM + c * 16 + lane, mask=ok, other=0.0)
            b = tl.load(y_ptr + row * y_row_stride + c * 16 + lane, mask=ok, other=0.0)
            lanes = lanes + a * b
        lanes = tl.sum(tl.reshape(lanes, (2, 8)), axis=0)  # [8]: lanes_j + lanes_{j+8}
        lanes = tl.sum(tl.reshape(lanes, (2, 4)), axis=0)
        lanes = tl.sum(tl.reshape(lanes, (2, 2)), axis=0)
        tl.store(out_ptr + row, tl.sum(lanes, axis=0))  # lanes_0 + lanes_1

    return lane_dot_kernel


def lane_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`ckernels.lane_dot`'s bits from the kernel on x's device (CUDA, or CPU under
    TRITON_INTERPRET=1): x fp32 [rows, dim], y fp32 [rows, dim] or [dim] -> fp32 [rows, 1]. The
    kernel is compiled per dim. Raises ValueError for a y of another shape."""
    rows, dim = x.shape
    if y.shape not in ((dim,), (rows, dim)):
        raise ValueError(f"y {tuple(y.shape)} does not fit x {tuple(x.shape)}: it must be [{dim}] or [{rows}, {dim}]")
    x, y = x.float().contiguous(), y.float().contiguous()
    out = torch.zeros(rows, 1, device=x.device)
    if rows == 0 or dim == 0:
        return out
    _kernel()[(rows,)](x, y, out, 0 if y.dim() == 1 else dim, DIM=dim, enable_fp_fusion=False)
    return out
