"""One rank's view of a GGUF: the same file, with each split tensor cut to this rank's slice.

`ShardedGGUF(gguf, splits, shards)` is a `GGUFFile` whose `tensor_info`, `raw_tensor` and
`tensor` give, for every tensor a family's `Split` names, only this rank's rows or columns
(`nn.parallel.Shards.range` over whole units: heads, FFN features, vocabulary rows). Handed to
`gguf.load.plan_weights` in place of the file, the family's ordinary tensor table and loader
fill a module built with the shard's sizes; a rank never reads, dequantises or holds another
rank's slice (the memory map is shared, only touched pages are read).

Quantised blocks run along the last (input) axis, so a row split is always exact on the stored
blocks; a column split (row-parallel o/down) is cut on block boundaries, which needs each
rank's first and last column to be a multiple of the type's block size (32 for Q4_0..Q8_0, 256
for the K types). Where it is not, `tensor` dequantises that one tensor whole and slices it
(a tensor, never the model), and `raw_tensor` (the `gguf` weight mode's stored blocks) raises
ShardNotBlockAligned: load such a file with another --dtype.

`gguf.load.load_trunk(..., shards=, splits=)` loads one rank's trunk through this view.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import attrs
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from verispec.errors import VerispecError
from verispec.gguf.io import GGUFFile
from verispec.nn.parallel import Shards

__all__ = ["ShardNotBlockAligned", "ShardedGGUF", "Split"]


class ShardNotBlockAligned(VerispecError, ValueError):
    """A column slice that would cut a quantised block, asked for as stored blocks."""


@attrs.frozen
class Split:
    """Tensors whose name matches `pattern` ("{i}" = a layer index) are split along `axis`
    (0: rows, the torch-order first axis; -1: columns) into `units` equal-as-possible runs of
    `unit` consecutive elements (heads of head_dim rows, FFN features, vocabulary rows)."""

    pattern: str
    axis: int
    units: int
    unit: int = 1

    def matches(self, name: str) -> bool:
        return re.fullmatch(re.escape(self.pattern).replace(r"\{i\}", r"\d+"), name) is not None


class ShardedGGUF(GGUFFile):
    """`gguf` seen by one rank: split tensors cut to `shards`' slice, the rest as stored."""

    def __init__(self, gguf: GGUFFile, splits: Iterable[Split], shards: Shards):
        super().__init__(gguf.path, gguf.version, gguf.metadata, gguf._kv_spans, gguf._tensors, gguf.data_offset,
                         gguf.alignment, gguf._mm)
        self.file, self.shards = gguf, shards
        self._splits = {name: split for name in gguf for split in splits if split.matches(name)}

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(axis, start, end) in elements of the split axis for a split tensor, else None."""
        split = self._splits.get(name)
        if split is None:
            return None
        start, end = self.shards.range(split.units)
        return split.axis, start * split.unit, end * split.unit

    def tensor_info(self, name: str):
        info = self.file.tensor_info(name)
        cut = self.slice_of(name)
        if cut is None:
            return info
        axis, start, end = cut
        shape = list(info.shape)
        shape[axis] = end - start
        full = int(np.prod(info.shape))
        return attrs.evolve(info, shape=tuple(shape), nbytes=info.nbytes * int(np.prod(shape)) // full)

    def raw_tensor(self, name: str):
        """The stored bytes of this rank's slice (a copy when cut, else the zero-copy view), its ggml
        type and its torch-order shape. Raises ShardNotBlockAligned for a column cut inside a block."""
        raw, ggml_type, shape = self.file.raw_tensor(name)
        cut = self.slice_of(name)
        if cut is None:
            return raw, ggml_type, shape
        axis, start, end = cut
        if axis == 0 and len(shape) > 1:  # whole rows of blocks (a 1-D tensor's one axis is its bytes)
            return np.ascontiguousarray(raw[start:end]), ggml_type, (end - start, *shape[1:])
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if start % block or end % block:
            raise ShardNotBlockAligned(
                f"{name} ({ggml_type.name}, blocks of {block}) split into columns [{start}, {end}) for rank "
                f"{self.shards.rank} of {self.shards.world_size}: the cut falls inside a block; load with "
                "--dtype int8 / bf16 / fp32 (dequantised, then sliced) or another --tp")
        cols = raw[..., start // block * type_size:end // block * type_size]
        return np.ascontiguousarray(cols), ggml_type, (*shape[:-1], end - start)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's slice, dequantised to fp32 (then `dtype`), as GGUFFile.tensor."""
        try:
            return super().tensor(name, dtype)
        except ShardNotBlockAligned:
            axis, start, end = self.slice_of(name)
            return self.file.tensor(name, dtype).narrow(axis, start, end - start).contiguous()
