"""Elementwise activations whose bits do not depend on how many rows a forward holds.

ATen runs sigmoid / silu / softplus / tanh-GELU vectorised over whole SIMD blocks of the
flattened tensor and the tail through a scalar path whose result can differ by an ulp. In an
[n, w] tensor with w not a multiple of the block, which elements of a row land in the tail
depends on n, so a row computed inside an n-row verify could round differently from the same
row alone (measured: silu and tanh-GELU over [n, 37] rows differ for most n = 2..16). Padding
each row to a multiple of 64 elements makes every row whole blocks, so it is bitwise the same
in any batch. Real checkpoints' widths are multiples of 64 and pay nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: elements per padded row: a multiple of every SIMD block width ATen uses on CPU (AVX-512: 16 fp32).
ROW_MULTIPLE = 64


def rowwise(fn, x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """fn (elementwise) over x [..., w], each last-dim row padded to a multiple of `multiple`
    elements; returns fn(x) with the same shape and dtype, batch-invariant per row."""
    pad = -x.shape[-1] % multiple
    return fn(F.pad(x, (0, pad)))[..., :x.shape[-1]] if pad else fn(x)
