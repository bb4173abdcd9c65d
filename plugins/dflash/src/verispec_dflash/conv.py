"""DFlash2's grouped dynamic depthwise causal convolution over the block rows (reference note §3 (i), §7).

    y[r][c] = Σ_{t=0}^{KS-1} [r >= t] · (base[t][c] + δ[r][t][⌊c/gs⌋]) · x[r-t][c]

x fp32 [n, H] (block rows only: the anchor row 0 has no left neighbour, context rows are never
convolved), δ fp32 [n, KS, G] computed at the output row r, base fp32 [KS, H], G = H / gs
contiguous channel groups. One projection of the sublayer's normed input gives both sides:
`dynamic_kernels` reshapes it to [n, 2, KS, G] (projection row = side·KS·G + t·G + g; side 0
filters the sublayer input, side 1 its output). Source: `dflash==0.1.0` GroupedDynamicCausalConv.
"""
from __future__ import annotations

import torch


def dynamic_kernels(x: torch.Tensor, projection: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """δ fp32 [n, 2, KS, G] of normed rows x fp32 [n, H]; projection fp32 [2·KS·G, H]."""
    return (x @ projection.T).reshape(x.shape[0], 2, kernel_size, -1)


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """y fp32 [n, H] of x fp32 [n, H], δ fp32 [n, KS, G], base fp32 [KS, H] (formula above)."""
    n = x.shape[0]
    y = torch.zeros_like(x)
    for t in range(min(base.shape[0], n)):
        shifted = x if t == 0 else torch.cat([x.new_zeros(t, x.shape[1]), x[:n - t]])
        kernel = base[t][None, :] + delta[:, t].repeat_interleave(group_size, dim=-1)  # [n, H]
        y = y + kernel * shifted
    return y
