"""Open and validate a GGUF file: typed metadata, tensor table, tensors as torch.

The file is memory-mapped once; parsing the header walks it with `struct` and decodes
string arrays (a 262k-token vocabulary) in one pass: 0.1 s for Gemma 3 270M, where
`gguf.GGUFReader` builds a numpy view per vocabulary entry and takes 9-24 s.
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
import math
import os
import struct
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from verispec.errors import VerispecError

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

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 counted with u32 and predates every file in use
_KNOWN_VERSIONS = (1, 2, 3)
#: a version field above this is garbage (no writer has got near it), unless it is a known
#: version byte-swapped (a big-endian file).
_MAX_PLAUSIBLE_VERSION = 255
#: more tensors or metadata keys than any model file holds (the largest have tens of thousands).
_MAX_PLAUSIBLE_ENTRIES = 1 << 24
#: arrays of arrays nest at most this deep (llama.cpp writes none); deeper is corruption,
#: refused before Python's recursion limit is reached.
_MAX_ARRAY_DEPTH = 8
_DEFAULT_ALIGNMENT = 32  # llama.cpp's GGUF_DEFAULT_ALIGNMENT

# scalar value types: struct format and numpy dtype (little-endian)
_SCALAR_FORMAT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPE = {vtype: np.dtype(fmt.replace("?", "b1")) for vtype, fmt in _SCALAR_FORMAT.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ggml types stored as plain values: read by reinterpreting the bytes
_PLAIN_NUMPY = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


# --- errors ---------------------------------------------------------------------------

class GGUFError(VerispecError):
    """Base class: a GGUF file cannot be read, or lacks what a loader needs."""


class NotGGUF(GGUFError):
    """A foreign file: it does not start with the GGUF magic."""

    def __init__(self, path: str, magic: bytes):
        self.path, self.magic = path, magic
        super().__init__(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "pass a .gguf model file (convert safetensors with llama.cpp's convert_hf_to_gguf.py)")


class TruncatedGGUF(GGUFError):
    """The file is shorter than its own header or tensor table says."""

    def __init__(self, path: str, needed_bytes: int, file_bytes: int, what: str):
        self.path, self.needed_bytes, self.file_bytes, self.what = path, needed_bytes, file_bytes, what
        super().__init__(
            f"{path} is truncated: {what} needs {needed_bytes:,} bytes but the file has {file_bytes:,}; "
            "the download or copy was cut short, fetch or assemble the file again")


class UnsupportedGGUFVersion(GGUFError):
    """A GGUF version this reader does not take: v1, a newer one, or a big-endian file (its
    version reads byte-swapped). A version field no writer produces is CorruptGGUF instead."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in _KNOWN_VERSIONS:
            hint = f"it is big-endian (version {swapped} byte-swapped); use a little-endian file"
        elif version > max(_SUPPORTED_VERSIONS):
            hint = "a newer format than this reader knows; re-convert it with a llama.cpp that writes v3"
        else:
            hint = "re-convert it with a current llama.cpp (writes v3)"
        super().__init__(f"{path} is GGUF version {version}; supported: "
                         f"{', '.join(map(str, _SUPPORTED_VERSIONS))}; {hint}")


class CorruptGGUF(GGUFError):
    """The header parses but contradicts itself (bad type id, misaligned or overlapping data)."""

    def __init__(self, path: str, detail: str):
        self.path, self.detail = path, detail
        super().__init__(f"{path} is corrupt: {detail}; re-download or re-convert the file")


class MissingKey(GGUFError):
    def __init__(self, key: str, arch: str | None, path: str):
        self.key, self.arch, self.path = key, arch, path
        super().__init__(
            f"{path} (architecture {arch!r}) has no metadata key {key!r}; the file was written by a "
            "converter that predates this model family, re-convert it with a current llama.cpp")


class MissingTensor(GGUFError):
    def __init__(self, name: str, arch: str | None, path: str | None = None):
        self.name, self.arch, self.path = name, arch, path
        super().__init__(
            f"{path or 'the GGUF'} (architecture {arch!r}) has no tensor {name!r}; it is incomplete or "
            "a different variant of this family: re-convert it with a current llama.cpp")


class BadTensorShape(GGUFError):
    def __init__(self, name: str, expected: tuple[int, ...], got: tuple[int, ...]):
        self.name, self.expected, self.got = name, tuple(expected), tuple(got)
        super().__init__(
            f"tensor {name!r} has shape {list(self.got)} but the metadata implies {list(self.expected)} "
            "(torch order); the file's metadata and weights disagree, re-convert it")


class UnsupportedTensorType(GGUFError):
    def __init__(self, name: str, ggml_type: int):
        self.name, self.ggml_type = name, ggml_type
        super().__init__(
            f"tensor {name!r} has ggml type {ggml_type}, which gguf {_gguf_version()} cannot dequantise; "
            "upgrade the `gguf` package or re-quantise the file (e.g. Q8_0, Q4_K)")


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


# --- value types ----------------------------------------------------------------------

@attrs.frozen
class TensorInfo:
    name: str
    #: torch order (GGUF dims reversed): a linear weight is [out, in].
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    #: absolute byte offset of the data in the file.
    offset: int
    nbytes: int

    @property
    def is_quantized(self) -> bool:
        return self.ggml_type not in _PLAIN_NUMPY and self.ggml_type != GGMLQuantizationType.BF16


# --- the parser -----------------------------------------------------------------------

class _Cursor:
    """Reads little-endian values from a buffer; any read past the end raises TruncatedGGUF."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise TruncatedGGUF(self.path, self.pos + n, self.size, what)

    def unpack(self, fmt: struct.Struct, what: str):
        self.need(fmt.size, what)
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def string(self, what: str) -> str:
        (length,) = self.unpack(_U64, what)
        self.need(length, what)
        start, self.pos = self.pos, self.pos + length
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError:
            raise CorruptGGUF(self.path, f"{what} at byte {start} is not UTF-8 text") from None

    def string_array(self, count: int, what: str) -> list[str]:
        # the hot loop of a 262k vocabulary: locals only, bounds checked once per string
        buf, pos, size, unpack_u64 = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise TruncatedGGUF(self.path, pos + 8, size, what)
                (length,) = unpack_u64(buf, pos)
                pos += 8
                if pos + length > size:
                    raise TruncatedGGUF(self.path, pos + length, size, what)
                append(str(buf[pos:pos + length], "utf-8"))
                pos += length
        except UnicodeDecodeError:
            detail = f"{what}, entry {len(out)} at byte {pos}, is not UTF-8 text"
            raise CorruptGGUF(self.path, detail) from None
        self.pos = pos
        return out

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        what = f"metadata value {key!r}"
        if vtype in _SCALAR_FORMAT:
            return self.unpack(struct.Struct(_SCALAR_FORMAT[vtype]), what)[0]
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            element_type, count = self.unpack(struct.Struct("<IQ"), what)
            if element_type in _SCALAR_DTYPE:
                dtype = _SCALAR_DTYPE[element_type]
                self.need(count * dtype.itemsize, what)
                array = np.frombuffer(self.buf, dtype, count, self.pos).copy()  # copy: don't pin the map
                self.pos += count * dtype.itemsize
                return array.astype(dtype.newbyteorder("="), copy=False)
            if element_type == GGUFValueType.STRING:
                return self.string_array(count, what)
            if element_type == GGUFValueType.ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise CorruptGGUF(self.path,
                                      f"metadata key {key!r} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
                return [self.value(GGUFValueType.ARRAY, key, depth + 1) for _ in range(count)]
            raise CorruptGGUF(self.path, f"metadata key {key!r} is an array of unknown type {element_type}")
        raise CorruptGGUF(self.path, f"metadata key {key!r} has unknown value type {vtype}")


def _open_map(path: str) -> np.memmap:
    size = os.path.getsize(path)
    if size < 4:
        raise TruncatedGGUF(path, 24, size, "the GGUF header")
    return np.memmap(path, mode="r", dtype=np.uint8)


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    magic = bytes(cur.buf[:4])
    if magic != _MAGIC:
        raise NotGGUF(cur.path, magic)
    cur.pos = 4
    (version,) = cur.unpack(_U32, "the GGUF header")
    if version not in _SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version > _MAX_PLAUSIBLE_VERSION and swapped not in _KNOWN_VERSIONS:
            raise CorruptGGUF(cur.path, f"the bytes after the magic (version field 0x{version:08x}) are no "
                                        "GGUF version any writer produces")
        raise UnsupportedGGUFVersion(cur.path, version)
    tensor_count, kv_count = cur.unpack(struct.Struct("<QQ"), "the GGUF header")
    # Each entry takes at least 8 bytes. Counts no model has (beyond _MAX_PLAUSIBLE_ENTRIES) are
    # corruption; plausible counts the file is too short to hold mean the file was cut short.
    if max(tensor_count, kv_count) > _MAX_PLAUSIBLE_ENTRIES:
        raise CorruptGGUF(cur.path, f"header claims {tensor_count} tensors and {kv_count} metadata keys")
    if 8 * (tensor_count + kv_count) > cur.size - cur.pos:
        raise TruncatedGGUF(cur.path, cur.pos + 8 * (tensor_count + kv_count), cur.size,
                            f"the table of the header's {tensor_count} tensors and {kv_count} metadata keys")
    return version, tensor_count, kv_count


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


def read_architecture(path: str | os.PathLike) -> str:
    """`general.architecture` of a GGUF, reading only the keys before it (usually the first).

    Raises NotGGUF, TruncatedGGUF, UnsupportedGGUFVersion, MissingKey.
    """
    path = os.fspath(path)
    cur = _Cursor(memoryview(_open_map(path)), path)
    _, _, kv_count = _read_header(cur)
    for _ in range(kv_count):
        key = cur.string("a metadata key")
        (vtype,) = cur.unpack(_U32, f"metadata key {key!r}")
        value = cur.value(vtype, key)
        if key == "general.architecture":
            return _architecture_text(value, path)
    raise MissingKey("general.architecture", None, path)


def _architecture_text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise CorruptGGUF(path, f"general.architecture is a {type(value).__name__}, not text")
    return value


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
        mm = _open_map(path)
        cur = _Cursor(memoryview(mm), path)
        version, tensor_count, kv_count = _read_header(cur)
        metadata: dict[str, Any] = {}
        kv_spans: dict[str, tuple[int, int]] = {}
        for _ in range(kv_count):
            start = cur.pos
            key = cur.string("a metadata key")
            (vtype,) = cur.unpack(_U32, f"metadata key {key!r}")
            metadata[key] = cur.value(vtype, key)
            kv_spans[key] = (start, cur.pos)
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer)):
            raise CorruptGGUF(path, f"general.alignment is a {type(alignment).__name__}, not an integer")
        alignment = int(alignment)
        if alignment <= 0 or alignment & (alignment - 1):
            raise CorruptGGUF(path, f"general.alignment={alignment} is not a power of two")
        entries = [_read_tensor_entry(cur) for _ in range(tensor_count)]
        data_offset = -(-cur.pos // alignment) * alignment
        tensors = {}
        for name, dims, ggml_type, rel_offset in entries:
            info = _tensor_info(path, name, dims, ggml_type, data_offset + rel_offset, alignment)
            if name in tensors:
                raise CorruptGGUF(path, f"tensor {name!r} appears twice in the tensor table")
            tensors[name] = info
        end = max((t.offset + t.nbytes for t in tensors.values()), default=data_offset)
        if end > cur.size:
            last = max(tensors.values(), key=lambda t: t.offset + t.nbytes)
            raise TruncatedGGUF(path, end, cur.size, f"tensor data (last tensor {last.name!r})")
        return cls(path, version, metadata, kv_spans, tensors, data_offset, alignment, mm)

    # -- metadata --

    @property
    def architecture(self) -> str:
        """`general.architecture`; raises MissingKey when absent, CorruptGGUF when not text."""
        return _architecture_text(self.require("general.architecture"), self.path)

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
        if ggml_type in _PLAIN_NUMPY:
            array = np.array(raw.view(_PLAIN_NUMPY[ggml_type]).reshape(shape))  # copy out of the map
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


def _read_tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("the tensor table")
    (n_dims,) = cur.unpack(_U32, f"tensor {name!r} info")
    if n_dims > 8:  # GGML_MAX_DIMS is 4; anything larger is garbage
        raise CorruptGGUF(cur.path, f"tensor {name!r} claims {n_dims} dimensions")
    dims = cur.unpack(struct.Struct(f"<{n_dims}Q"), f"tensor {name!r} info")
    ggml_type, rel_offset = cur.unpack(struct.Struct("<IQ"), f"tensor {name!r} info")
    return name, tuple(reversed(dims)), ggml_type, rel_offset


def _tensor_info(path: str, name: str, shape: tuple[int, ...], ggml_type: int, offset: int,
                 alignment: int) -> TensorInfo:
    # ggml counts elements in int64 (llama.cpp's gguf.c refuses the same): a dim of 2**60 beside
    # a zero one would otherwise pass the size check and break every view of the tensor
    if math.prod(max(d, 1) for d in shape) >= 1 << 63:
        raise CorruptGGUF(path,
                          f"tensor {name!r} claims shape {list(shape)}, more elements than int64 counts")
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedTensorType(name, ggml_type) from None
    if shape and shape[-1] % block_size:
        raise CorruptGGUF(path, f"tensor {name!r} row length {shape[-1]} is not a multiple of "
                                f"{qtype.name}'s block size {block_size}")
    if offset % alignment:
        raise CorruptGGUF(path, f"tensor {name!r} data offset {offset} is not {alignment}-byte aligned")
    nbytes = math.prod(shape) // block_size * type_size
    return TensorInfo(name, shape, qtype, offset, nbytes)
