"""GGUF blocks -> unsigned integers with per-group scales (and mins), without requantising.

Every type below stores, per group of G input columns, small integers q and fp16-derived
scales; each weight is w = u · s + m with u = q + z an unsigned integer (z the type's zero
point, making a signed q unsigned) and m = -z · s for a type without mins. `unpack` returns
(u, s, m) so that `(u - z) · s` (no mins) or `u · s + m` (mins) is gguf-py's dequantisation
bitwise (tests/test_gguf_weights.py checks every type on random blocks):

| type | block: weights (bytes): fields                      | file's w            | u         | s      | m         |
|------|-----------------------------------------------------|---------------------|-----------|--------|-----------|
| Q4_0 | 32 (18): f16 d, 16 B nibbles                        | d·(q - 8)           | q (z = 8) | d      | -         |
| Q4_1 | 32 (20): f16 d, f16 m, 16 B nibbles                 | d·q + m             | q         | d      | m         |
| Q4_K | 256 (144): f16 d, f16 dmin, 12 B 6-bit sc/m, nibbles| d·sc_j·q - dmin·m_j | q         | d·sc_j | -dmin·m_j |
| Q5_0 | 32 (22): f16 d, 4 B high bits, 16 B nibbles         | d·(q - 16)          | q (z = 16)| d      | -         |
| Q5_1 | 32 (24): f16 d, f16 m, 4 B high bits, 16 B nibbles  | d·q + m             | q         | d      | m         |
| Q5_K | 256 (176): as Q4_K + 32 B high bits                 | d·sc_j·q - dmin·m_j | q         | d·sc_j | -dmin·m_j |
| Q6_K | 256 (210): 128 B low nibbles, 64 B 2-bit highs,     | d·sc_j·(q - 32)     | q (z = 32)| d·sc_j | -         |
|      | 16 int8 sc_j (groups of 16), f16 d                  |                     |           |        |           |
| Q8_0 | 32 (34): f16 d, 32 int8 q                           | d·q                 | q + 128 (z = 128) | d | -     |

Bit layouts follow gguf-py `gguf.quants` (<Type>.dequantize_blocks) and ggml-quants.c
dequantize_row_*: in a 32-weight Q4/Q5 block byte i holds weight i (low nibble) and weight
i + 16 (high nibble), bit i of Q5's 32-bit field is weight i's fifth bit; in Q4_K/Q5_K each
32-byte chunk c of nibbles holds sub-block 2c (low) and 2c + 1 (high), bit j of Q5_K's high
byte i is sub-block j's weight i; Q4_K's 12 scale bytes pack eight 6-bit (sc, m) pairs (j < 4:
low 6 bits of bytes j and j + 4; j >= 4: the nibbles of byte j + 4, top bits from the top bits
of bytes j - 4 and j). Products d·sc are exact in fp32 (11 + 6 or 8 significant bits).

The K types' s and m are such products: `unpack` also returns their factors (`BlockValues.factors`:
the super-block's fp16 d or -dmin per 256 columns, and the integer sc or m per group), which the
block kernel stores instead of the fp32 products (a byte a group, not four) and multiplies back,
exactly, as it reads them.
"""
from __future__ import annotations

import attrs
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["BLOCK_FORMATS", "SUPER_BLOCK", "BlockFormat", "BlockValues", "GGUFBlocks", "unpack"]

T = GGMLQuantizationType


@attrs.frozen
class BlockFormat:
    """How a type's values reach the block kernel (weights.block_linear): G columns per scale, the
    zero point z, whether it has mins, the bits of u (4, 5, 6 or 8: the packed size), and
    whether its scales and mins are the file's fp16 fields (half_scales: kept as fp16, exact) or
    products d·sc of a super-block's fp16 factor and a small integer per group (the K types:
    kept as those factors, see `SUPER_BLOCK`)."""

    group: int
    zero: int
    has_mins: bool
    bits: int
    half_scales: bool


#: columns per K-type super-block: one fp16 factor (d, dmin) per row and SUPER_BLOCK columns.
SUPER_BLOCK = 256


#: the ggml types the block kernel takes as stored.
BLOCK_FORMATS = {
    T.Q4_0: BlockFormat(32, 8, False, 4, True), T.Q4_1: BlockFormat(32, 0, True, 4, True),
    T.Q4_K: BlockFormat(32, 0, True, 4, False), T.Q5_0: BlockFormat(32, 16, False, 5, True),
    T.Q5_1: BlockFormat(32, 0, True, 5, True), T.Q5_K: BlockFormat(32, 0, True, 5, False),
    T.Q6_K: BlockFormat(16, 32, False, 6, False), T.Q8_0: BlockFormat(32, 128, False, 8, True),
}


@attrs.frozen(eq=False)
class GGUFBlocks:
    """One quantised 2-D tensor as the file stores it.

    data: uint8 [rows, cols / block_size * type_size], one row of blocks per output feature.
    """

    ggml_type: GGMLQuantizationType
    data: torch.Tensor
    cols: int

    @classmethod
    def from_raw(cls, raw, ggml_type: GGMLQuantizationType, shape) -> GGUFBlocks:
        """The blocks of `GGUFFile.raw_tensor(name)`'s (raw uint8 array, type, shape), copied out of
        the file's memory map; `raw` may be one expert's slice of a 3-D tensor."""
        import numpy as np

        return cls(ggml_type, torch.from_numpy(np.array(raw)), shape[-1])

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@attrs.frozen(eq=False)
class BlockValues:
    """A tensor's values in the block kernel's terms: u uint8 [rows, cols], s fp32 [rows,
    cols / G], m fp32 like s or None (no mins); w = (u - z) · s or u · s + m.

    factors (K types, else None): (s_super, s_int, m_super, m_int) with s = s_super[:, g // (256 / G)]
    · s_int[:, g] exactly: *_super fp32 [rows, cols / 256] (fp16 values: d, -dmin), *_int int8
    [rows, cols / G] (sc, m); m_super and m_int None without mins.
    """

    format: BlockFormat
    u: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor | None
    factors: tuple | None = None

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]: gguf-py's dequantisation of the blocks, bitwise."""
        g = self.format.group
        s = self.s.repeat_interleave(g, dim=1)
        if self.m is None:
            return (self.u.float() - self.format.zero) * s
        return self.u.float() * s + self.m.repeat_interleave(g, dim=1)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor, run: int) -> torch.Tensor:
    """uint8 [..., run·c] -> [..., 2·run·c]: each `run`-byte run gives its low nibbles, then its high ones."""
    runs = packed.unflatten(-1, (-1, run))  # [..., c, run]
    return torch.cat([runs & 15, runs >> 4], dim=-1).flatten(-2)


def _bits(packed: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., len(shifts)·n]: (byte >> shift) & mask for each shift in turn."""
    return torch.cat([(packed >> s) & mask for s in shifts], dim=-1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., 12] -> (sc, m) fp32 [..., 8], Q4_K/Q5_K's 6-bit sub-block scales and mins."""
    b = packed.int()
    low, high, mixed = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc.float(), m.float()


def _group_ints(x: torch.Tensor) -> torch.Tensor:
    """A K type's per-group integers fp32 [rows, nb, groups a block] -> int8 [rows, nb · groups] (exact)."""
    return x.reshape(x.shape[0], -1).to(torch.int8)


def unpack(blocks: GGUFBlocks) -> BlockValues:
    """The stored blocks as BLOCK_FORMATS values (table above). Raises ValueError for a type
    outside BLOCK_FORMATS (the caller chooses the class by type)."""
    kind = blocks.ggml_type
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"{kind.name} blocks have no block-kernel format; unpack takes "
                         f"{', '.join(t.name for t in BLOCK_FORMATS)}")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    b = blocks.data.reshape(blocks.rows, blocks.cols // block_size, type_size)  # [rows, nb, type_size]
    m = factors = None
    if kind == T.Q4_0:
        s, u = _f16(b[..., 0:2]), _nibbles(b[..., 2:], 16)
    elif kind == T.Q4_1:
        s, m, u = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:], 16)
    elif kind in (T.Q5_0, T.Q5_1):
        s = _f16(b[..., 0:2])
        if kind == T.Q5_1:
            m = _f16(b[..., 2:4])
        high, low = b[..., -20:-16], b[..., -16:]
        u = _nibbles(low, 16) | (_bits(high, range(8), 1).unflatten(-1, (8, 4)).transpose(-1, -2).flatten(-2) << 4)
    elif kind in (T.Q4_K, T.Q5_K):
        sc, mins = _k_scales(b[..., 4:16])  # [rows, nb, 8]
        d, neg_dmin = _f16(b[..., 0:2]), -_f16(b[..., 2:4])
        s = d[..., None] * sc
        m = neg_dmin[..., None] * mins  # = -(dmin · m) bitwise: negation is exact
        factors = (d, _group_ints(sc), neg_dmin, _group_ints(mins))
        if kind == T.Q4_K:
            u = _nibbles(b[..., 16:], 32)  # 32-byte chunk c: sub-block 2c, then 2c + 1
        else:
            high = _bits(b[..., 16:48], range(8), 1)  # [.., 8 · 32]: sub-block j's fifth bits
            u = _nibbles(b[..., 48:], 32) | (high << 4)
    elif kind == T.Q6_K:
        low = torch.cat([_nibbles(half, 64) for half in b[..., :128].split(64, dim=-1)], dim=-1)
        high = torch.cat([_bits(half, range(0, 8, 2), 3) for half in b[..., 128:192].split(32, dim=-1)], dim=-1)
        u = low | (high << 4)
        d, sc = _f16(b[..., 208:210]), b[..., 192:208].contiguous().view(torch.int8).float()
        s = d[..., None] * sc  # [rows, nb, 16]
        factors = (d, _group_ints(sc), None, None)
    else:  # Q8_0
        s = _f16(b[..., 0:2])
        u = (b[..., 2:].contiguous().view(torch.int8).int() + 128).to(torch.uint8)
    rows = blocks.rows
    return BlockValues(BLOCK_FORMATS[kind], u.reshape(rows, blocks.cols).to(torch.uint8), s.reshape(rows, -1),
                       None if m is None else m.reshape(rows, -1), factors)
