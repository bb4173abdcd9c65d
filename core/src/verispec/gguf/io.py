"""Open and validate a GGUF file: typed metadata, tensor table, tensors as torch.

The file is memory-mapped once and its header parsed by `gguf.header.parse` (0.1 s for Gemma 3
270M's 262k-token vocabulary); the errors it raises are `gguf.errors`' (listed here too).
Tensor data stays in the map until asked for: `raw_tensor` returns a read-only view of
the stored bytes, `tensor` dequantises through `gguf.quants.dequantize`.

Layout (GGUF v2/v3, little-endian; ggml-org/ggml:docs/gguf.md):
  magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
  kv_count x (string key, u32 value_type, value)
  tensor_count x (string name, u32 n_dims, u64 dims[n_dims] fastest-first, u32 ggml_type, u64 offset)
  padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

Shapes here are torch order: the GGUF dims reversed, so a linear weight is [out, in].
numpy and torch are the only heavy imports; torch is imported inside `tensor()`, so
`read_architecture` (used to pick a plugin) stays light.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.gguf.errors import (BadTensorShape, CorruptGGUF, GGUFError, MissingKey, MissingTensor, NotGGUF,
                                  TruncatedGGUF, UnsupportedGGUFVersion, UnsupportedTensorType)
from verispec.gguf.header import PLAIN_NUMPY, TensorInfo, architecture_text, parse, read_architecture

if TYPE_CHECKING:
    import torch

__all__ = [
    "BadTensorShape",
    "CorruptGGUF",
    "GGUFError",
    "GGUFFile",
    "MissingKey",
    "MissingTensor",
    "NotGGUF",
    "TensorInfo",
    "TruncatedGGUF",
    "UnsupportedGGUFVersion",
    "UnsupportedTensorType",
    "arch_value",
    "read_architecture",
]

def arch_value(metadata: Mapping[str, Any], suffix: str, default: Any = ..., *, source: str = "the GGUF") -> Any:
    """metadata[f"{arch}.{suffix}"], arch = metadata["general.architecture"]; `default` when the
    key is absent, else raises MissingKey naming `source` (the file's path)."""
    arch = metadata.get("general.architecture")
    key = f"{arch}.{suffix}"
    if key in metadata:
        return metadata[key]
    if default is ...:
        raise MissingKey(key, arch, source)
    return default


class GGUFFile:
    """A parsed GGUF: metadata, tensor table, and the memory map its tensors live in.

    Open with `GGUFFile.open(path)`. Tensors are read on demand; views returned by
    `raw_tensor` keep the map alive.
    """

    def __init__(self, path: str, version: int, metadata: dict[str, Any],
                 kv_spans: dict[str, tuple[int, int]], tensors: dict[str, TensorInfo],
                 data_offset: int, alignment: int, mm: np.memmap):
        self.path = path
        self.version = version
        #: key -> Python value: int / float / bool / str; numeric and bool arrays as 1-D numpy
        #: arrays; string arrays as list[str]; nested arrays as lists.
        self.metadata: Mapping[str, Any] = metadata
        self._kv_spans = kv_spans
        self._tensors = tensors
        self.data_offset = data_offset
        self.alignment = alignment
        self._mm = mm

    # -- opening --

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        """Parse header, metadata and tensor table; check every tensor's bytes lie in the file.

        Raises NotGGUF, TruncatedGGUF, UnsupportedGGUFVersion, CorruptGGUF, UnsupportedTensorType.
        """
        path = os.fspath(path)
        return cls(path, *parse(path))

    # -- metadata --

    @property
    def architecture(self) -> str:
        """`general.architecture`; raises MissingKey when absent, CorruptGGUF when not text."""
        return architecture_text(self.require("general.architecture"), self.path)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """metadata[key]; raises MissingKey naming the file and its architecture."""
        try:
            return self.metadata[key]
        except KeyError:
            raise MissingKey(key, self.metadata.get("general.architecture"), self.path) from None

    def arch_key(self, suffix: str, default: Any = ...) -> Any:
        """metadata[f"{architecture}.{suffix}"]; with no default, raises MissingKey when absent."""
        return arch_value(self.metadata, suffix, default, source=self.path)

    def metadata_digest(self, prefix: str = "") -> str:
        """sha256 hex of the raw bytes of every metadata entry whose key starts with `prefix`,
        in file order: a content key for caches (e.g. "tokenizer." for a built tokenizer)."""
        digest = hashlib.sha256()
        for key, (start, end) in self._kv_spans.items():
            if key.startswith(prefix):
                digest.update(self._mm[start:end])
        return digest.hexdigest()

    # -- tensors --

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensor(name, self.metadata.get("general.architecture"), self.path) from None

    def expect_shape(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """The tensor's info, after checking its torch-order shape equals `shape`.

        Raises MissingTensor, BadTensorShape."""
        info = self.tensor_info(name)
        if info.shape != tuple(shape):
            raise BadTensorShape(name, tuple(shape), info.shape)
        return info

    def raw_tensor(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """The stored bytes, zero-copy: (read-only uint8 view [*shape[:-1], bytes_per_row],
        ggml type, logical torch-order shape). For a quantised linear [out, in] the view is
        [out, in // block_size * type_size]: one row of blocks per output feature."""
        info = self.tensor_info(name)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block_size * type_size) if info.shape else ()
        view = self._mm[info.offset:info.offset + info.nbytes]
        return view.reshape(byte_shape), info.ggml_type, info.shape

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor as a new torch tensor in torch order, dequantised to fp32 (through
        `gguf.quants.dequantize`) then cast to `dtype` (default torch.float32).

        F16/BF16 requested in their own dtype are copied without an fp32 round trip; integer
        tensors keep their integer dtype unless `dtype` is given.
        Raises MissingTensor, UnsupportedTensorType.
        """
        import torch
        from gguf.quants import dequantize

        raw, ggml_type, shape = self.raw_tensor(name)
        if ggml_type in PLAIN_NUMPY:
            array = np.array(raw.view(PLAIN_NUMPY[ggml_type]).reshape(shape))  # copy out of the map
            out = torch.from_numpy(array)
            if out.is_floating_point() and dtype is None:
                dtype = torch.float32
            return out if dtype is None else out.to(dtype)
        if ggml_type == GGMLQuantizationType.BF16:
            bits = torch.from_numpy(np.array(raw.view(np.int16).reshape(shape)))
            return bits.view(torch.bfloat16).to(dtype or torch.float32)
        try:
            array = dequantize(raw, ggml_type)
        except NotImplementedError:
            raise UnsupportedTensorType(name, ggml_type) from None
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype or torch.float32)

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, arch={self.metadata.get('general.architecture')!r}, "
                f"v{self.version}, {len(self.metadata)} keys, {len(self._tensors)} tensors)")


