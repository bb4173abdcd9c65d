"""Rotary position embeddings (RoPE), one module for every family.

- `style="neox"` (rotate-half; HF's layout, llama.cpp NEOX): dim i pairs with i + r/2.
- `style="normal"` (GPT-J interleaved; llama.cpp NORM, for GGUF llama Q/K left permuted):
  dim 2i pairs with 2i + 1.
- Partial rotary: only the first `rotary_dim` = 2·len(inv_freq) dims rotate, the rest pass
  through (qwen35's partial_rotary_factor).
- Frequencies are data: build `inv_freq` with `default_inv_freq` / `proportional_inv_freq`
  and reshape them with a scaling hook (`linear_scaling`, `freq_factors`; llama3-style
  scaling plugs in the same way).

Angles are pos · inv_freq in fp32, cos/sin in fp32, as transformers computes them
(`modeling_rope_utils`, `apply_rotary_pos_emb`), so fp32 parity is not spoiled by a
more accurate but different angle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

InvFreqScaling = Callable[[torch.Tensor], torch.Tensor]


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 [rotary_dim/2]: theta^(-2i/rotary_dim). Source: transformers compute_default_rope_parameters."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def proportional_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float) -> torch.Tensor:
    """fp32 [head_dim/2]: Gemma 4's full-layer RoPE. The first `factor·head_dim/2` pairs get
    theta^(-2i/head_dim) (denominator: the *whole* head dim), the others frequency 0 (identity).
    Source: transformers _compute_proportional_rope_parameters; docs/reference/gemma4.md §3.3."""
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
    rotated = 1.0 / (theta ** exponents)
    return torch.cat([rotated, torch.zeros(head_dim // 2 - rope_angles)])


def linear_scaling(factor: float) -> InvFreqScaling:
    """Position interpolation: pos / factor (Gemma 3 4B+ global layers use factor 8)."""
    return lambda inv_freq: inv_freq / factor


def freq_factors(factors: Sequence[float] | torch.Tensor) -> InvFreqScaling:
    """llama.cpp's `rope_freqs` tensor: each frequency divided by its factor (1e30 ≈ off)."""
    factors = torch.as_tensor(factors, dtype=torch.float32)
    return lambda inv_freq: inv_freq / factors


class RotaryEmbedding(nn.Module):
    """Apply RoPE to [n, H, Dh] rows at absolute positions.

    inv_freq: fp32 [r/2]; rotates dims [0, r) of each head (r = rotary_dim <= Dh).
    Usage: `cos, sin = rope.cos_sin(positions)` once per forward, then
    `rope(x, cos, sin)` for q and k of every layer. cos/sin: fp32 [n, 1, r], laid out as
    the rotation reads them (sin signed), so a layer pays three elementwise ops.
    """

    #: (cos, sin) fp32 [P, 1, r] of positions 0 .. P - 1 on a trunk's device (`tabulate`); None: computed per forward
    table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, inv_freq: torch.Tensor, *, style: str = "neox", scaling: InvFreqScaling | None = None):
        super().__init__()
        if style not in ("neox", "normal"):
            raise ValueError(f"RoPE style={style!r}: use 'neox' (rotate-half) or 'normal' (interleaved pairs)")
        inv_freq = inv_freq.float()
        if scaling is not None:
            inv_freq = scaling(inv_freq).float()
        self.style = style
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def default(cls, rotary_dim: int, theta: float, *, style: str = "neox",
                scaling: InvFreqScaling | None = None) -> RotaryEmbedding:
        return cls(default_inv_freq(rotary_dim, theta), style=style, scaling=scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [n] -> (cos, sin) fp32 [n, 1, r]: neox [c, c] and [-s, s] by halves,
        normal (c, c) and (-s, s) by pairs, so rope(x) = x·cos + swap(x)·sin (`forward`)."""
        if self.table is not None:  # a trunk on a device: rows of the table, no transcendental there
            return self.table[0][positions], self.table[1][positions]
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [n, r/2]
        cos, sin = angles.cos(), angles.sin()
        if self.style == "neox":
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # [n, r]
        else:
            cos = torch.stack([cos, cos], dim=-1).flatten(-2)  # [n, r]
            sin = torch.stack([-sin, sin], dim=-1).flatten(-2)
        return cos[:, None, :], sin[:, None, :]

    def tabulate(self, num_positions: int, device: torch.device) -> None:
        """Compute (cos, sin) of positions 0 .. num_positions - 1 on the CPU, in chunks of 64 rows
        (a forward chunk's shape), and keep them on `device`: a device forward then indexes them,
        so its RoPE has the CPU path's bits (a GPU's cos/sin round differently) and costs no
        transcendental. fp32 [P, 1, r] each: num_positions · r · 8 bytes."""
        self.table = None
        inv_freq, self.inv_freq = self.inv_freq, self.inv_freq.cpu()
        try:
            pieces = [self.cos_sin(torch.arange(p, min(p + 64, num_positions)))
                      for p in range(0, num_positions, 64)]
        finally:
            self.inv_freq = inv_freq
        self.table = tuple(torch.cat(part).to(device) for part in zip(*pieces))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: fp32 [n, H, Dh] -> fp32 [n, H, Dh] (new tensor).

        x·cos + swap(x)·sin is transformers' `x·cos + rotate_half(x)·sin`: bitwise the pairwise
        form x1·c - x2·s, x2·c + x1·s (a + b·(-s) rounds as a - b·s)."""
        r = self.rotary_dim
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        if self.style == "neox":
            swapped = torch.cat([rot[..., r // 2:], rot[..., :r // 2]], dim=-1)  # [x2, x1]
        else:
            swapped = rot.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)  # (x2, x1) per pair
        rotated = rot * cos + swapped * sin
        return rotated if rest is None else torch.cat([rotated, rest], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, style={self.style!r}"
