"""The GGUF block matmul in Triton: `weights.block_linear.reference_matmul`'s arithmetic on a GPU.

y fp32 [n, out] = x fp32 [n, k] · Wᵀ with W a GGUF tensor's own quantised values (every type
of weights.gguf_blocks.BLOCK_FORMATS: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), the same
bits as qmatmul.c and its PyTorch statement. The caller (`BlockLinear.forward`) gives:

- the activations quantised per 32 columns (`block_linear.quantize_activations`, llama.cpp's
  quantize_row_q8_0: d = amax / 127, a = rint(x · (1 / d)) int8, S = the a's sums per 16
  columns), computed in PyTorch on the tensors' device: elementwise IEEE division,
  multiplication and round-half-even and an exact max, so the same bits on CPU and GPU;
- the weight as w = u - z int8 [out, k] (a byte a weight, unpacked: every type's u minus its
  zero point z fits int8), s fp32 [out, k / G] and, for types with mins, m fp32 [out, k / G]
  (the K types' d · sc products, exact in fp32).

Output: one program per tile of BLOCK_M rows × BLOCK_N outputs, y = 0, then for every group h
of G columns in order (no split of k, so nothing depends on the batch):
    I = sum_i w_i a_i                       (int32, exact in any order; = sum u a - z · S_h)
    y = y + (float)I · (s_h · d_b)
    y = y + (m_h · d_b) · (float)S_h        (types with mins only)
each an IEEE fp32 operation; the launch passes enable_fp_fusion=False so the compiler forms no
fused multiply-add on the GPU. A row's bits depend on nothing but the row and the weights: not
on the other rows, the tile sizes or the grid.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported: the tests' path); `triton_dispatch.use_triton` says which.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["qmatmul"]


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` is made a
    module global: the interpreter patches the language module through the kernel's globals."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def qmatmul_kernel(a_ptr, d_ptr, S_ptr, w_ptr, s_ptr, m_ptr, y_ptr, n, out, k,
                       G: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < n, cols < out
        i = tl.arange(0, G)
        groups = k // G
        y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h in range(0, groups):  # the fixed order: group by group along k
            a = tl.load(a_ptr + rows[:, None] * k + h * G + i[None, :], mask=row_ok[:, None], other=0)
            w = tl.load(w_ptr + cols[None, :] * k + h * G + i[:, None], mask=col_ok[None, :], other=0)
            prod = a.to(tl.int32)[:, :, None] * w.to(tl.int32)[None, :, :]  # [M, G, N]
            I = tl.sum(prod, axis=1)  # exact int32
            db = tl.load(d_ptr + rows * (k // 32) + (h * G) // 32, mask=row_ok, other=0.0)
            sh = tl.load(s_ptr + cols * groups + h, mask=col_ok, other=0.0)
            y = y + I.to(tl.float32) * (sh[None, :] * db[:, None])
            if HAS_MINS:
                mh = tl.load(m_ptr + cols * groups + h, mask=col_ok, other=0.0)
                Sh = tl.load(S_ptr + rows * (k // 16) + (h * G) // 16, mask=row_ok, other=0)
                if G == 32:
                    Sh = Sh + tl.load(S_ptr + rows * (k // 16) + (h * G) // 16 + 1, mask=row_ok, other=0)
                y = y + (mh[None, :] * db[:, None]) * Sh.to(tl.float32)[:, None]
        tl.store(y_ptr + rows[:, None] * out + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])

    return qmatmul_kernel


def qmatmul(a: torch.Tensor, d: torch.Tensor, S: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
            m: torch.Tensor | None, group: int, *, block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """a int8 [n, k], d fp32 [n, k / 32], S int32 [n, k / 16] (quantised activations), w int8
    [out, k], s fp32 [out, k / group], m fp32 like s or None, group 16 or 32, all contiguous on
    one device -> y fp32 [n, out]: `block_linear.reference_matmul`'s bits for any n and any
    block_m, block_n (powers of two). Raises ValueError when a's k is not w's or not a multiple
    of 32; ImportError without triton."""
    n, k = a.shape
    out = w.shape[0]
    if k % 32 or k != w.shape[1]:
        raise ValueError(f"the activations have {k} columns; the weight takes {w.shape[1]} (a multiple of 32)")
    y = torch.empty(n, out, dtype=torch.float32, device=a.device)
    if n == 0:
        return y
    grid = (-(-n // block_m), -(-out // block_n))
    _kernel()[grid](a, d, S, w, s, s if m is None else m, y, n, out, k, G=group, HAS_MINS=m is not None,
                    BLOCK_M=block_m, BLOCK_N=block_n, enable_fp_fusion=False)
    return y
