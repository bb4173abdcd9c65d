"""The GGUF block matmul in Triton: `weights.block_linear.reference_matmul`'s arithmetic on a GPU.

y fp32 [n, out] = x fp32 [n, k] · Wᵀ with W a GGUF tensor's own quantised values (every type
of weights.gguf_blocks.BLOCK_FORMATS: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), the same
bits as qmatmul.c and its PyTorch statement:

- activations: each row quantised per 32 columns by `block_linear.quantize_activations`
  (llama.cpp's quantize_row_q8_0: d = amax / 127, a = rint(x · (1 / d)) int8, S = the a's sums
  per 16 columns). It runs in PyTorch on the tensors' device: elementwise IEEE division,
  multiplication and round-half-even, and an exact max, so the same bits on CPU and GPU.
- weights (`TritonBlockWeights`): w = u - z as int8 [out, k] (a byte a weight, unpacked: the
  value u of every type minus its zero point z fits int8), s fp32 [out, k / G] and, for types
  with mins, m fp32 [out, k / G] (the K types' d · sc products, exact in fp32).
- output: one program per tile of BLOCK_M rows × BLOCK_N outputs, y = 0, then for every group h
  of G columns in order (no split of k, so nothing depends on the batch):
      I = sum_i w_i a_i                       (int32, exact: any order; = sum u a - z · S_h)
      y = y + (float)I · (s_h · d_b)
      y = y + (m_h · d_b) · (float)S_h        (types with mins only)
  each an IEEE fp32 operation; the launch passes enable_fp_fusion=False so the compiler forms
  no fused multiply-add on the GPU. A row's bits depend on nothing but the row and the weights:
  not on the other rows, the tile sizes or the grid.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before the first call: the tests' path). Triton is optional (`available()`).
"""
from __future__ import annotations

import functools

import attrs
import torch

from verispec.weights.block_linear import BLOCK, quantize_activations
from verispec.weights.gguf_blocks import BlockValues

__all__ = ["TritonBlockWeights", "available", "qmatmul"]


def available() -> bool:
    """Whether the `triton` package imports (pip install triton; Linux x86_64 / aarch64 wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@attrs.frozen(eq=False)
class TritonBlockWeights:
    """A block-typed weight as the Triton kernel reads it: w int8 [out, k] (= u - z), s fp32
    [out, k / group], m fp32 like s or None (no mins), group 16 or 32."""

    w: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor | None
    group: int

    @classmethod
    def from_values(cls, values: BlockValues, device: torch.device | str | None = None) -> TritonBlockWeights:
        """From unpacked values (`gguf_blocks.unpack`, `BlockLinear.values()`), moved to `device`."""
        fmt = values.format
        w = (values.u.to(torch.int16) - fmt.zero).to(torch.int8)  # exact: u - z is in [-128, 127]
        m = None if values.m is None else values.m.float().contiguous().to(device)
        return cls(w.contiguous().to(device), values.s.float().contiguous().to(device), m, fmt.group)


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


def qmatmul(x: torch.Tensor, weights: TritonBlockWeights, *, block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """x fp32 [n, k] (k % 32 == 0) -> y fp32 [n, out] on x's device; `block_linear.reference_matmul`'s
    bits for any n and any block_m, block_n (powers of two). Raises ValueError for a k that is
    not the weight's or not a multiple of 32, and ImportError when triton is not installed."""
    n, k = x.shape
    out = weights.w.shape[0]
    if k % BLOCK or k != weights.w.shape[1]:
        raise ValueError(f"x has {k} columns; the weight takes {weights.w.shape[1]} (a multiple of {BLOCK})")
    a, d, S = quantize_activations(x.float().contiguous())
    y = torch.empty(n, out, dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    m = weights.m if weights.m is not None else weights.s  # unread without mins
    grid = (-(-n // block_m), -(-out // block_n))
    _kernel()[grid](a, d, S, weights.w, weights.s, m, y, n, out, k, G=weights.group,
                    HAS_MINS=weights.m is not None, BLOCK_M=block_m, BLOCK_N=block_n, enable_fp_fusion=False)
    return y
