"""GGUF 4-bit blocks -> int4 groups of 32 with a scale and a zero, without requantising.

`aten._weight_int4pack_mm_for_cpu` dequantises w = (q - 8) · scale + zero per group of 32
input columns, q in [0, 15] (measured: an fma in fp32, torch 2.13 CPU). The file's Q4_0,
Q4_1 and Q4_K blocks already hold 4-bit q with per-32 affine scales, so each maps exactly:

| type | block: weights (bytes): fields          | file's w            | scale  | zero                |
|------|-----------------------------------------|---------------------|--------|---------------------|
| Q4_0 | 32 (18): f16 d, 16 B nibbles            | d·(q - 8)           | d      | 0                   |
| Q4_1 | 32 (20): f16 d, f16 m, 16 B nibbles     | d·q + m             | d      | m + 8·d             |
| Q4_K | 256 (144): f16 d, f16 dmin, 12 B packed | d·sc_j·q - dmin·m_j | d·sc_j | 8·d·sc_j - dmin·m_j |
|      | 6-bit sc_j/m_j (j < 8), 128 B nibbles   |                     |        |                     |

Nibble order (gguf-py `gguf.quants` Q4_0/Q4_1/Q4_K.dequantize_blocks; ggml-quants.c
dequantize_row_q4_0/q4_1/q4_K): in a 32-weight block byte i holds weight i (low nibble) and
weight i + 16 (high nibble); in Q4_K each 32-byte chunk c of the nibbles holds sub-block 2c
(low nibbles) and sub-block 2c + 1 (high nibbles). Q4_K's 12 scale bytes pack eight 6-bit
(sc, m) pairs: j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the nibbles of byte
j + 4 with their top two bits in the top bits of bytes j - 4 and j (`Q4_K.get_scale_min`).

Products d·sc·(q - 8) are exact in fp32 (11 + 6 + 4 significant bits); a zero that sums
two fp16-derived terms is exact unless their exponents lie more than 13 apart. The kernel's
fast path takes bf16 scales only, so nn.quant.GGUFInt4Linear rounds them (bound stated there).
"""
from __future__ import annotations

import attrs
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GROUP", "INT4_TYPES", "GGUFBlocks", "unpack_int4"]

#: input columns per scale/zero pair: a Q4_0/Q4_1 block, a Q4_K sub-block.
GROUP = 32
#: ggml types whose blocks are 4-bit values in groups of GROUP with an affine scale.
INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K})


@attrs.frozen(eq=False)
class GGUFBlocks:
    """One quantised 2-D tensor as the file stores it.

    data: uint8 [rows, cols / block_size * type_size], one row of blocks per output feature.
    """

    ggml_type: GGMLQuantizationType
    data: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor, run: int) -> torch.Tensor:
    """uint8 [..., run·c] -> [..., 2·run·c]: each `run`-byte run gives its low nibbles, then its high ones."""
    runs = packed.unflatten(-1, (-1, run))  # [..., c, run]
    return torch.cat([runs & 15, runs >> 4], dim=-1).flatten(-2)


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., 12] -> (sc, m) int32 [..., 8], the 6-bit sub-block scales and mins."""
    b = packed.int()
    low, high, mixed = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc, m


def unpack_int4(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored blocks as int4 groups: (q uint8 [rows, cols] in [0, 15], scale fp32
    [rows, cols / GROUP], zero fp32 [rows, cols / GROUP]) with w = (q - 8) · scale + zero.

    Raises ValueError for a type outside INT4_TYPES (the caller chooses the class by type).
    """
    kind = blocks.ggml_type
    block_size, type_size = GGML_QUANT_SIZES[kind]
    b = blocks.data.reshape(blocks.rows, blocks.cols // block_size, type_size)  # [rows, nb, type_size]
    if kind == GGMLQuantizationType.Q4_0:
        scale = _f16(b[..., 0:2])  # [rows, nb]: one group per block
        zero = torch.zeros_like(scale)
        q = _nibbles(b[..., 2:], 16)
    elif kind == GGMLQuantizationType.Q4_1:
        scale, low = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        zero = low + 8 * scale
        q = _nibbles(b[..., 4:], 16)
    elif kind == GGMLQuantizationType.Q4_K:
        sc, m = _q4_k_scales(b[..., 4:16])  # [rows, nb, 8]
        scale = _f16(b[..., 0:2])[..., None] * sc.float()
        zero = 8 * scale - _f16(b[..., 2:4])[..., None] * m.float()
        q = _nibbles(b[..., 16:], 32)  # 32-byte chunk c: sub-block 2c, then 2c + 1
    else:
        raise ValueError(f"{kind.name} blocks are not 4-bit groups; unpack_int4 takes "
                         f"{', '.join(sorted(t.name for t in INT4_TYPES))}")
    return q.reshape(blocks.rows, blocks.cols), scale.reshape(blocks.rows, -1), zero.reshape(blocks.rows, -1)
