"""GGUF -> LlamaConfig -> LlamaForCausalLM: one tensor-name table, dequantise, tokenizer.

The GGUF's tensors are dequantised to fp32 through `verispec.gguf_io` (gguf.quants), loaded
into the module, and converted to the weight dtype by `verispec.nn.quant.swap_linears`. The
converted state dict is cached under `cache_dir("weights")` (`verispec cache` shows and
clears it), keyed by the file's header, size, mtime and a sample of its tensor bytes plus
the dtype, and memory-mapped on the next load: SmolLM2's int8 load drops from ~8 s to <1 s.

Q/K rows are taken as the file holds them (llama's are permuted by llama.cpp's converter);
`modeling_llama` applies the matching RoPE pairing, so nothing is un-permuted here.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import attrs
import torch

from verispec.gguf_io import GGUFFile
from verispec_llama.modeling_llama import LlamaConfig, LlamaForCausalLM, UnsupportedLlamaVariant

__all__ = ["load", "DEFAULT_DTYPE", "TENSOR_NAMES", "state_dict_from_gguf"]

#: int8 weight-only: batch-invariant (a verify row is bitwise the decode row) and the fastest
#: here; k rows cost ~1x one row up to k=4 (README.md "Verify cost").
DEFAULT_DTYPE = "int8"

# bump when the conversion changes: older cache entries are then ignored
_CONVERSION_VERSION = 1

#: GGUF tensor name -> module state-dict name (GGUF names: gguf.constants.TENSOR_NAMES for
#: MODEL_ARCH.LLAMA / QWEN2; biases are the same names with ".bias").
TENSOR_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{bid}.attn_norm.weight": "layers.{bid}.input_layernorm.weight",
    "blk.{bid}.attn_q.weight": "layers.{bid}.self_attn.q_proj.weight",
    "blk.{bid}.attn_k.weight": "layers.{bid}.self_attn.k_proj.weight",
    "blk.{bid}.attn_v.weight": "layers.{bid}.self_attn.v_proj.weight",
    "blk.{bid}.attn_output.weight": "layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.attn_q.bias": "layers.{bid}.self_attn.q_bias",
    "blk.{bid}.attn_k.bias": "layers.{bid}.self_attn.k_bias",
    "blk.{bid}.attn_v.bias": "layers.{bid}.self_attn.v_bias",
    "blk.{bid}.attn_output.bias": "layers.{bid}.self_attn.o_bias",
    "blk.{bid}.ffn_norm.weight": "layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_gate.weight": "layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "layers.{bid}.mlp.down_proj.weight",
}
# read into the config (llama3-style frequency factors), not the state dict
_ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         use_cache: bool = True) -> LlamaForCausalLM:
    """Load a llama/qwen2 GGUF as a trunk, with `.tokenizer` from the file's vocabulary.

    dtype: weight dtype "int8" (default) | "bfloat16" | "float32" (verispec.nn.quant).
    context_length: max_context_length in tokens (default: the file's context_length).
    use_cache: read/write the converted weights under cache_dir("weights").
    Raises gguf_io errors (MissingKey, MissingTensor, BadTensorShape, ...),
    UnsupportedLlamaVariant, UnknownWeightDtype, Int8ShapeUnsupported.
    """
    from verispec.tokenizer import Tokenizer

    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    dtype = dtype or DEFAULT_DTYPE
    model = LlamaForCausalLM(config, dtype=dtype, max_context_length=context_length)
    cache_file = _cache_file(gguf, dtype) if use_cache else None
    if not _load_cached(model, cache_file):
        state = _convert(gguf, config, dtype)
        if cache_file is not None:
            _write_cached(cache_file, state)
        model.load_state_dict(state, assign=True)
    model.tokenizer = Tokenizer.from_gguf(gguf)
    return model.eval()


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    """The config of an opened GGUF, with `rope_freqs` factors when the file has them."""
    config = LlamaConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                   source=gguf.path)
    if _ROPE_FREQS in gguf:
        factors = gguf.expect_shape(_ROPE_FREQS, (config.rotary_dim // 2,))
        config = attrs.evolve(config, rope_freq_factors=tuple(gguf.tensor(factors.name).tolist()))
    return config


def state_dict_from_gguf(gguf: GGUFFile, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the file (but rope_freqs) dequantised to fp32 under its module name,
    shape-checked against the config. Raises MissingTensor, BadTensorShape,
    UnsupportedLlamaVariant (a tensor this math does not use)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {
        "token_embd.weight": (v, d), "output_norm.weight": (d,), "output.weight": (v, d),
        "attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d), "attn_v.weight": (kv, d),
        "attn_output.weight": (d, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "attn_output.bias": (d,), "ffn_norm.weight": (d,), "ffn_gate.weight": (i, d), "ffn_up.weight": (i, d),
        "ffn_down.weight": (d, i),
    }
    wanted = _wanted_tensors(config)
    unknown = sorted(set(gguf) - set(wanted) - {_ROPE_FREQS})
    if unknown:
        raise UnsupportedLlamaVariant(gguf.path, f"tensors this llama/qwen2 math does not use: {unknown[:6]}",
                                      "the file is another variant (MoE, extra norms); it cannot be served here")
    state = {}
    for gguf_name, module_name in wanted.items():
        gguf.expect_shape(gguf_name, shapes[_BLOCK.sub("", gguf_name)])
        state[module_name] = gguf.tensor(gguf_name)
    return state


def _wanted_tensors(config: LlamaConfig) -> dict[str, str]:
    """GGUF name -> module name for every tensor this config reads."""
    optional = {"output.weight": not config.tie_word_embeddings,
                "blk.{bid}.attn_q.bias": config.attention_bias, "blk.{bid}.attn_k.bias": config.attention_bias,
                "blk.{bid}.attn_v.bias": config.attention_bias, "blk.{bid}.attn_output.bias": config.attention_out_bias}
    wanted = {}
    for gguf_name, module_name in TENSOR_NAMES.items():
        if not optional.get(gguf_name, True):
            continue
        bids = range(config.num_hidden_layers) if "{bid}" in gguf_name else [None]
        for bid in bids:
            wanted[gguf_name.format(bid=bid)] = module_name.format(bid=bid)
    return wanted


def _convert(gguf: GGUFFile, config: LlamaConfig, dtype: str) -> dict[str, torch.Tensor]:
    """The state dict of a `dtype` model: fp32 weights loaded, then linears swapped (quantised)."""
    from verispec.nn.quant import swap_linears

    model = LlamaForCausalLM(config, dtype="float32", max_context_length=1)
    model.load_state_dict(state_dict_from_gguf(gguf, config), assign=True)
    if dtype != "float32":
        swap_linears(model, dtype)
    return model.state_dict()


# --- the converted-weight cache ---------------------------------------------------------

def _cache_file(gguf: GGUFFile, dtype: str):
    from verispec.checkpoints import cache_dir

    return cache_dir("weights") / f"{gguf.architecture}-{_content_key(gguf)}-{dtype}.pt"


def _content_key(gguf: GGUFFile, num_samples: int = 16, sample_bytes: int = 4096) -> str:
    """sha256 over the header (every metadata entry, the tensor table), the file size and
    mtime, and `num_samples` evenly spaced windows of the tensor data: two fixtures with one
    config but different random weights never share an entry."""
    digest = hashlib.sha256()
    stat = os.stat(gguf.path)
    tensors = [(t.name, t.shape, int(t.ggml_type), t.offset) for t in map(gguf.tensor_info, gguf)]
    digest.update(json.dumps([_CONVERSION_VERSION, torch.__version__, stat.st_size, stat.st_mtime_ns,
                              gguf.metadata_digest(), tensors]).encode())
    with open(gguf.path, "rb") as f:
        span = max(stat.st_size - gguf.data_offset - sample_bytes, 0)
        for k in range(num_samples):
            f.seek(gguf.data_offset + span * k // max(num_samples - 1, 1))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:24]


def _load_cached(model: LlamaForCausalLM, cache_file) -> bool:
    """Fill `model` from its cache entry (memory-mapped); False when there is none. A damaged
    or mismatching entry is deleted and rebuilt, never trusted."""
    if cache_file is None or not cache_file.is_file():
        return False
    try:
        model.load_state_dict(torch.load(cache_file, mmap=True, weights_only=True), assign=True)
        return True
    except Exception:
        cache_file.unlink(missing_ok=True)
        return False


def _write_cached(cache_file, state: dict[str, torch.Tensor]) -> None:
    tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.partial")
    try:
        torch.save(state, tmp)
        os.replace(tmp, cache_file)
    finally:
        tmp.unlink(missing_ok=True)
