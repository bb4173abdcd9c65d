"""The errors of reading a GGUF file: each names the file, what is wrong and the fix."""
from __future__ import annotations

from verispec.errors import VerispecError

#: GGUF versions this reader takes (v1 counted with u32 and predates every file in use), and every
#: version a writer has produced.
SUPPORTED_VERSIONS = (2, 3)
KNOWN_VERSIONS = (1, 2, 3)


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
        if swapped in KNOWN_VERSIONS:
            hint = f"it is big-endian (version {swapped} byte-swapped); use a little-endian file"
        elif version > max(SUPPORTED_VERSIONS):
            hint = "a newer format than this reader knows; re-convert it with a llama.cpp that writes v3"
        else:
            hint = "re-convert it with a current llama.cpp (writes v3)"
        super().__init__(f"{path} is GGUF version {version}; supported: "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {hint}")


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
