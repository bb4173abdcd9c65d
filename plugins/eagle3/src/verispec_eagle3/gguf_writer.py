"""Write an EAGLE-3 head as an `eagle3` GGUF with llama.cpp's names and keys (through gguf-py's GGUFWriter).

`write_eagle3_gguf(path, tensors, ...)`: tensors by GGUF name in torch order (the `config`
module's table: fc, blk.0.*, output_norm, and the optional output / token_embd / rope_freqs /
enc.output_norm), d2t as absolute target ids (written I64, as llama.cpp's converter does). The
keys are the ones llama.cpp's eagle3 loader reads, derived from the tensor shapes; `vocab` (the
target's `tokenizer.*` keys, as the converter copies them from --target-model-dir) is optional.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def write_eagle3_gguf(path: str | os.PathLike, tensors: Mapping[str, Any], *, target_layers: Sequence[int],
                      num_heads: int, num_kv_heads: int, rms_eps: float = 1e-5, rope_theta: float = 10000.0,
                      context_length: int = 2048, d2t: Any = None, norm_before_residual: bool = False,
                      norm_before_fc: bool = False, vocab: Mapping[str, Any] | None = None,
                      extra_metadata: Mapping[str, Any] | None = None, name: str = "eagle3 head",
                      tensor_types: Mapping[str, str] | None = None) -> str:
    """Write the head to `path`; returns the path. extra_metadata: keys added or overridden (a
    value None removes the key), to make variants. tensor_types: GGUF name -> a ggml type gguf-py
    quantises ("Q8_0", "F16", ...; default F32), as `llama-quantize` leaves a head's linears.
    Raises KeyError for a missing fc / blk.0 tensor."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    fc, q = np.asarray(tensors["fc.weight"]), np.asarray(tensors["blk.0.attn_q.weight"])
    hidden, head_dim = fc.shape[0], q.shape[0] // num_heads
    meta: dict[str, Any] = {
        "general.name": (GGUFValueType.STRING, name),
        "eagle3.block_count": (GGUFValueType.UINT32, 1),
        "eagle3.context_length": (GGUFValueType.UINT32, context_length),
        "eagle3.embedding_length": (GGUFValueType.UINT32, hidden),
        "eagle3.feed_forward_length": (GGUFValueType.UINT32, np.asarray(tensors["blk.0.ffn_gate.weight"]).shape[0]),
        "eagle3.attention.head_count": (GGUFValueType.UINT32, num_heads),
        "eagle3.attention.head_count_kv": (GGUFValueType.UINT32, num_kv_heads),
        "eagle3.attention.key_length": (GGUFValueType.UINT32, head_dim),
        "eagle3.attention.value_length": (GGUFValueType.UINT32, head_dim),
        "eagle3.attention.layer_norm_rms_epsilon": (GGUFValueType.FLOAT32, rms_eps),
        "eagle3.rope.dimension_count": (GGUFValueType.UINT32, head_dim),
        "eagle3.rope.freq_base": (GGUFValueType.FLOAT32, rope_theta),
        "eagle3.target_layers": (GGUFValueType.ARRAY, [int(x) for x in target_layers], GGUFValueType.INT32),
        "eagle3.target_hidden_size": (GGUFValueType.UINT32, fc.shape[1] // len(target_layers)),
        "eagle3.norm_before_residual": (GGUFValueType.BOOL, bool(norm_before_residual)),
        "eagle3.norm_before_fc": (GGUFValueType.BOOL, bool(norm_before_fc)),
    }
    if vocab and "tokenizer.ggml.tokens" in vocab:
        meta["eagle3.vocab_size"] = (GGUFValueType.UINT32, len(vocab["tokenizer.ggml.tokens"]))
    writer = GGUFWriter(os.fspath(path), "eagle3")
    for key, value in {**(vocab or {}), **(extra_metadata or {})}.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value if isinstance(value, tuple) else _typed(value)
    for key, (kind, value, *sub) in meta.items():
        writer.add_key_value(key, value, kind, sub[0] if sub else None)
    for tensor_name, tensor in tensors.items():
        array = tensor.detach().float().numpy() if hasattr(tensor, "detach") else np.asarray(tensor, np.float32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        qtype = GGMLQuantizationType[(tensor_types or {}).get(tensor_name, "F32")]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, array)
        else:
            writer.add_tensor(tensor_name, quantize(array, qtype), raw_dtype=qtype)
    if d2t is not None:
        ids = d2t.detach().numpy() if hasattr(d2t, "detach") else np.asarray(d2t)
        writer.add_tensor("d2t", np.ascontiguousarray(ids, dtype=np.int64), raw_dtype=GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def _typed(value) -> tuple:
    """(GGUFValueType, value[, element type]) by llama.cpp's usual types: bool, u32 counts (i32 when
    negative), f32, strings, and arrays of one of them (numpy arrays by their dtype)."""
    from gguf import GGUFValueType

    if isinstance(value, np.ndarray):
        kind = {np.dtype(np.int32): GGUFValueType.INT32, np.dtype(np.uint32): GGUFValueType.UINT32,
                np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.bool_): GGUFValueType.BOOL}[value.dtype]
        return GGUFValueType.ARRAY, value.tolist(), kind
    if isinstance(value, (list, tuple)):
        kinds = {_typed(v)[0] for v in value}
        kind = GGUFValueType.INT32 if kinds == {GGUFValueType.UINT32, GGUFValueType.INT32} else kinds.pop()
        return GGUFValueType.ARRAY, list(value), kind
    if isinstance(value, bool):
        return GGUFValueType.BOOL, value
    if isinstance(value, (int, np.integer)):
        return (GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32), int(value)
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, float(value)
    if isinstance(value, str):
        return GGUFValueType.STRING, value
    raise TypeError(f"cannot store metadata {value!r}; give (GGUFValueType, value[, element type])")
