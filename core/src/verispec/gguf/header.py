"""The GGUF parser: header, metadata and tensor table, read from a memory map with `struct`.

String arrays (a 262k-token vocabulary) are decoded in one pass: 0.1 s for Gemma 3 270M,
where `gguf.GGUFReader` builds a numpy view per vocabulary entry and takes 9-24 s. Every
count and offset is checked against the file before it is used (`TruncatedGGUF`,
`CorruptGGUF`). Layout: see `gguf.io`.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from verispec.gguf.errors import (KNOWN_VERSIONS, SUPPORTED_VERSIONS, CorruptGGUF, MissingKey, NotGGUF,
                                  TruncatedGGUF, UnsupportedGGUFVersion, UnsupportedTensorType)

_MAGIC = b"GGUF"
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
PLAIN_NUMPY = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


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
        return self.ggml_type not in PLAIN_NUMPY and self.ggml_type != GGMLQuantizationType.BF16


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
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version > _MAX_PLAUSIBLE_VERSION and swapped not in KNOWN_VERSIONS:
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


def parse(path: str) -> tuple[int, dict[str, Any], dict[str, tuple[int, int]], dict[str, TensorInfo], int, int,
                              np.memmap]:
    """Parse header, metadata and tensor table of the GGUF at `path`; check every tensor's bytes
    lie in the file. Returns (version, metadata, key -> byte span, tensors, data offset,
    alignment, the memory map). Raises NotGGUF, TruncatedGGUF, UnsupportedGGUFVersion,
    CorruptGGUF, UnsupportedTensorType."""
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
    return version, metadata, kv_spans, tensors, data_offset, alignment, mm


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
            return architecture_text(value, path)
    raise MissingKey("general.architecture", None, path)


def architecture_text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise CorruptGGUF(path, f"general.architecture is a {type(value).__name__}, not text")
    return value
