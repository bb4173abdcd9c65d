"""Write small GGUF fixtures with llama.cpp's key and tensor names (on `gguf.GGUFWriter`).

A family's tests build a tiny random transformers model, map its state dict to GGUF names
with their own HF->GGUF table (names, Gemma's norm +1, llama's Q/K permutation), and call

    write_gguf(path, arch="gemma3",
               metadata={"gemma3.block_count": 2, "gemma3.embedding_length": 48, ...},
               tensors={"token_embd.weight": emb, "blk.0.attn_q.weight": wq, ...},
               vocab="byte-level", tensor_types={"blk.0.attn_q.weight": "Q8_0"})

The writer knows no family: keys arrive fully spelled (`{arch}.block_count`, ...), tensors
in torch order ([out, in] for a linear; the GGUF dims are written reversed, as llama.cpp
expects). Value types follow llama.cpp's readers: see `_value_type`.

`byte_level_vocab(vocab_size)` is a tokenizer `verispec.tokenizer` loads (llama.cpp too, once
`tokenizer.ggml.pre` is overridden to "default": the llama.cpp vendored by llama-cpp-python
0.3.36 refuses the "gpt2" name written here; models/qwen35/tests/test_llama_cpp_crosscheck.py),
sized to fit a tiny config's vocabulary (e.g. 131 or 300), so `verispec generate` runs on a
fixture. Layout (ids in this order):

  0 `<pad>`, 1 `<eos>`, 2 `<bos>`, 3 `<unk>`         CONTROL, as in Gemma's first four ids
  byte tokens (GPT-2 byte-to-unicode spelling)      NORMAL, ascending byte value
  merged tokens from `_MERGES` ("Ġt", "he", ...)    NORMAL, with their `tokenizer.ggml.merges`
  `<unused0>`, `<unused1>`, ...                     CONTROL padding up to vocab_size

With vocab_size >= 4 + 256 + 32 every byte and all 32 merges are present. Smaller
vocabularies keep the printable ASCII bytes plus \\n \\t \\r first and drop the rest (text
using a dropped byte encodes to `<unk>`), and always keep at least one merge, because
llama.cpp refuses a "gpt2" vocabulary without merges. The minimum vocab_size is 4 + 98 + 1.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType, TokenType
from gguf.gguf_writer import GGUFValue
from gguf.quants import quantize

__all__ = ["SPECIAL_TOKENS", "byte_level_vocab", "bytes_to_unicode", "plant_values", "write_gguf"]

#: the control tokens every byte-level fixture vocabulary starts with, at ids 0..3.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")

# A few frequent English GPT-2 merges, each built only from bytes and earlier merges.
_MERGES = (
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o",
    "e n", "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b", "e d", "Ġ f", "in g", "Ġ p",
    "o u", "Ġa n", "a l", "a r", "Ġt o", "Ġ m", "Ġo f", "Ġ in",
)
_FIRST_BYTES = tuple(range(0x20, 0x7F)) + (0x0A, 0x09, 0x0D)  # kept when the vocab is small


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 encoder.py):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_vocab(vocab_size: int, *, chat_template: str | None = None) -> dict[str, Any]:
    """Tokenizer metadata (`tokenizer.*` keys) for a byte-level BPE vocabulary of exactly
    `vocab_size` tokens; layout in the module docstring. BOS 2, EOS 1, no BOS added by default
    (as GPT-2 style vocabularies do). Raises ValueError below the minimum size (103)."""
    minimum = len(SPECIAL_TOKENS) + len(_FIRST_BYTES) + 1
    if vocab_size < minimum:
        raise ValueError(f"byte_level_vocab needs vocab_size >= {minimum}, got {vocab_size}; "
                         "give the tiny config a larger vocabulary")
    spell = bytes_to_unicode()
    room = vocab_size - len(SPECIAL_TOKENS)
    num_bytes = min(256, room - 1)
    priority = list(_FIRST_BYTES) + [b for b in range(256) if b not in _FIRST_BYTES]
    kept = sorted(priority[:num_bytes])
    tokens = list(SPECIAL_TOKENS) + [spell[b] for b in kept]
    merges = []
    for merge in _MERGES:
        left, right = merge.split(" ")
        if len(tokens) < vocab_size and left in tokens and right in tokens:
            tokens.append(left + right)
            merges.append(merge)
    num_padding = vocab_size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(num_padding)]
    token_type = np.full(vocab_size, TokenType.NORMAL, dtype=np.int32)
    token_type[:len(SPECIAL_TOKENS)] = TokenType.CONTROL
    if num_padding:
        token_type[-num_padding:] = TokenType.CONTROL
    vocab: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": SPECIAL_TOKENS.index("<bos>"),
        "tokenizer.ggml.eos_token_id": SPECIAL_TOKENS.index("<eos>"),
        "tokenizer.ggml.unknown_token_id": SPECIAL_TOKENS.index("<unk>"),
        "tokenizer.ggml.padding_token_id": SPECIAL_TOKENS.index("<pad>"),
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        vocab["tokenizer.chat_template"] = chat_template
    return vocab


def write_gguf(path: str | os.PathLike, *, arch: str, metadata: Mapping[str, Any],
               tensors: Mapping[str, Any], vocab: str | Mapping[str, Any] | None = "byte-level",
               tensor_types: Mapping[str, str | GGMLQuantizationType] | None = None,
               vocab_size: int | None = None) -> str:
    """Write a GGUF v3 file and return its path.

    metadata: full llama.cpp key -> value (types per `_value_type`; a `gguf.GGUFValue`
      pins a type explicitly). `general.architecture` is set from `arch`.
    tensors: GGUF tensor name -> torch.Tensor or np.ndarray, torch order.
    vocab: "byte-level" (see `byte_level_vocab`; size from `vocab_size`, else the rows of
      `token_embd.weight`), an explicit mapping of `tokenizer.*` keys, or None (no tokenizer).
    tensor_types: GGUF name -> "F32" (default) | "F16" | "BF16" | "Q8_0" | any type
      `gguf.quants.quantize` implements; quantised rows must be a multiple of the block size.
      A uint8 array with a quantised type is taken as the stored blocks themselves
      ([..., row_bytes], e.g. random Q4_K blocks, which gguf-py cannot quantise).
    """
    tensor_types = dict(tensor_types or {})
    unknown = set(tensor_types) - set(tensors)
    if unknown:
        raise ValueError(f"tensor_types names tensors that are not written: {sorted(unknown)}")
    if vocab == "byte-level":
        if vocab_size is None:
            if "token_embd.weight" not in tensors:
                raise ValueError("vocab='byte-level' needs vocab_size= or a token_embd.weight tensor")
            vocab_size = int(tensors["token_embd.weight"].shape[0])
        vocab = byte_level_vocab(vocab_size)
    writer = GGUFWriter(os.fspath(path), arch)
    for key, value in {**(vocab or {}), **metadata}.items():
        if key == "general.architecture":
            continue
        if not isinstance(value, GGUFValue):
            value = GGUFValue(value, *_value_type(key, value))
        writer.add_key_value(key, _plain(value.value), value.type, value.sub_type)
    for name, tensor in tensors.items():
        array = _numpy(tensor)
        qtype = GGMLQuantizationType[tensor_types[name]] if isinstance(tensor_types.get(name), str) \
            else tensor_types.get(name, GGMLQuantizationType.F32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def plant_values(path: str | os.PathLike, dest: str | os.PathLike, name: str, values: Any) -> str:
    """A copy of the GGUF at `path`, written to `dest`, whose F32 / F16 tensor `name` starts
    (flat, file order) with `values` (e.g. `[float("nan")]`, to check that a loader names a
    damaged tensor); everything else byte for byte. Returns `dest` as a str.
    Raises gguf.errors.MissingTensor, ValueError (another type, or more values than the tensor has)."""
    import shutil

    from verispec.gguf.io import GGUFFile

    info = GGUFFile.open(path).tensor_info(name)
    dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(info.ggml_type)
    values = np.asarray(values, dtype=dtype)
    if dtype is None or values.size > info.nbytes // values.itemsize:
        raise ValueError(f"{name} is {info.ggml_type.name} with {info.nbytes} bytes: plant_values writes "
                         f"the first values of an F32 or F16 tensor")
    shutil.copyfile(path, dest)
    with open(dest, "r+b") as f:
        f.seek(info.offset)
        f.write(values.tobytes())
    return os.fspath(dest)


def _value_type(key: str, value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    """llama.cpp's types: counts and ids u32 (i32 if negative), floats f32, bools, strings;
    numpy arrays keep their dtype (token_type i32, scores f32, per-layer u32/bool arrays);
    lists take the type of their elements by the same rule."""
    if isinstance(value, np.ndarray):
        return GGUFValueType.ARRAY, _NUMPY_TYPES[value.dtype]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key!r} is an empty array; GGUF cannot store one, leave it out")
        element_types = {_value_type(key, v)[0] for v in value}
        if element_types == {GGUFValueType.UINT32, GGUFValueType.INT32}:
            element_types = {GGUFValueType.INT32}
        if len(element_types) != 1:
            raise ValueError(f"metadata {key!r} mixes element types {sorted(t.name for t in element_types)}")
        return GGUFValueType.ARRAY, element_types.pop()
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return (GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT32
                if -2**31 <= value < 0 else GGUFValueType.INT64), None
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    raise ValueError(f"metadata {key!r}: cannot store a {type(value).__name__}; "
                     "give int, float, bool, str, a list of them, a numpy array or a gguf.GGUFValue")


_NUMPY_TYPES = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.uint64): GGUFValueType.UINT64, np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.float64): GGUFValueType.FLOAT64,
    np.dtype(np.bool_): GGUFValueType.BOOL,
}


def _plain(value: Any) -> Any:
    """numpy arrays/scalars -> Python values, as GGUFWriter packs with struct."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _numpy(tensor: Any) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    return tensor.detach().to("cpu").float().numpy() if tensor.is_floating_point() \
        else tensor.detach().to("cpu").numpy()
