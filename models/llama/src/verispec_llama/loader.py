"""GGUF -> config -> module for llama and qwen2 files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TargetSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf_io): metadata and the tensor table.
2. `LlamaConfig.from_gguf` (+ the `rope_freqs` factors when present) and a model on the
   meta device.
3. Weights: one name table (GGUF name -> HF parameter name); each tensor dequantised to fp32
   (gguf.quants), shape-checked, converted to its module's weight dtype one at a time
   (nn.quant), then `load_state_dict(assign=True)`. Q/K rows are taken as the file holds them
   (llama's are permuted by llama.cpp's converter); `modeling_llama` applies the matching RoPE
   pairing, so nothing is un-permuted here.
   Dequantising and requantising takes seconds (SmolLM2 ~8 s, Qwen2.5-Coder-0.5B ~30 s), so
   the converted state goes through `verispec.weight_cache` and the next load memory-maps
   it (SmolLM2: ~0.5 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).
"""
from __future__ import annotations

import os
import re

import attrs
import torch
from verispec.weight_cache import cached_state
from verispec.gguf_io import GGUFFile
from verispec.nn.norm import RMSNorm
from verispec.nn.quant import Float32Linear, canonical_dtype

from verispec_llama.modeling_llama import LlamaConfig, LlamaForCausalLM, UnsupportedLlamaVariant

__all__ = ["DEFAULT_DTYPE", "TENSOR_NAMES", "config_from_gguf", "convert_state", "load"]

#: weight dtype when the caller does not choose one. int8 weight-only: batch-invariant (a
#: verify row is bitwise the one-row decode), the fastest decode, and a k-row verify that
#: costs about one row up to k = 4 (measurements in the package README).
DEFAULT_DTYPE = "int8"

#: GGUF tensor name -> parameter name in our modules (HF's names); "{i}" = layer index.
#: gguf-py MODEL_TENSORS[LLAMA] / [QWEN2]; biases are the same names with ".bias".
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",  # only in files with an untied LM head
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_bias",  # qwen2; llama with attention_bias
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_bias",  # llama with attention_bias
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
#: llama3-style frequency factors: read into the config, not the state dict.
ROPE_FREQS = "rope_freqs.weight"

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         threads: int | None = None, max_rows_per_forward: int | None = None, use_cache: bool = True,
         tokenizer: bool = True, progress: bool | None = None) -> LlamaForCausalLM:
    """Load a llama or qwen2 GGUF as a `LlamaForCausalLM` trunk.

    dtype: "int8" (default) | "bfloat16"/"bf16" | "float32"/"fp32".
    context_length: max positions (default: the file's context_length).
    max_rows_per_forward: forward chunk (default: nn.quant.rows_per_forward(dtype)).
    use_cache: read/write converted weights under verispec's cache dir.
    progress: tqdm bar while converting (None: on a terminal, after a second).
    Raises gguf_io errors (MissingKey, MissingTensor, BadTensorShape, ...),
    UnsupportedLlamaVariant, nn.quant.UnknownWeightDtype.
    """
    path = os.fspath(path)
    dtype = canonical_dtype(dtype or DEFAULT_DTYPE)
    if threads:
        torch.set_num_threads(threads)
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    model = LlamaForCausalLM(config, dtype=dtype, context_length=context_length,
                             max_rows_per_forward=max_rows_per_forward)
    names = expand_names(config)
    unused = sorted(set(gguf) - set(names.values()) - {ROPE_FREQS})
    if unused:
        raise UnsupportedLlamaVariant(path, f"tensors the llama/qwen2 math does not use: {unused[:6]}",
                                      "the file is another variant (MoE, extra norms) and cannot be served here")
    state = cached_state(gguf, dtype, lambda: convert_state(gguf, model, names, progress), use_cache=use_cache,
                         layout="llama")
    model.load_state_dict(state, assign=True)
    model.eval()
    if tokenizer:
        from verispec.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_gguf(gguf)
    return model


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    """The config of an opened GGUF, with the `rope_freqs` factors when the file has them."""
    config = LlamaConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                   source=gguf.path)
    if ROPE_FREQS in gguf:
        gguf.expect_shape(ROPE_FREQS, (config.rotary_dim // 2,))
        config = attrs.evolve(config, rope_freq_factors=tuple(gguf.tensor(ROPE_FREQS).tolist()))
    return config


def expand_names(config: LlamaConfig) -> dict[str, str]:
    """Our parameter name -> GGUF tensor name for every tensor this config reads."""
    present = {
        "output.weight": not config.tie_word_embeddings,
        "blk.{i}.attn_q.bias": config.attention_bias, "blk.{i}.attn_k.bias": config.attention_bias,
        "blk.{i}.attn_v.bias": config.attention_bias, "blk.{i}.attn_output.bias": config.attention_out_bias,
    }
    out = {}
    for gguf_name, ours in TENSOR_NAMES.items():
        if not present.get(gguf_name, True):
            continue
        if "{i}" in gguf_name:
            for i in range(config.num_hidden_layers):
                out[ours.format(i=i)] = gguf_name.format(i=i)
        else:
            out[ours] = gguf_name
    return out


def convert_state(gguf: GGUFFile, model: LlamaForCausalLM, names: dict[str, str],
                  progress: bool | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict read from `gguf`: each linear converted to its module's weight
    dtype, norms and biases fp32 as stored. Raises MissingTensor, BadTensorShape."""
    from tqdm.auto import tqdm

    expected = {}  # parameter name -> (linear module or None, torch-order shape)
    for prefix, module in model.named_modules():
        if isinstance(module, Float32Linear):
            expected[f"{prefix}.weight"] = (module, (module.out_features, module.in_features))
        elif isinstance(module, RMSNorm):
            expected[f"{prefix}.weight"] = (None, (module.dim,))
    for name, param in model.named_parameters():
        if name.endswith("_bias"):
            expected[name] = (None, tuple(param.shape))
    state = {}
    for name, (module, shape) in tqdm(expected.items(), desc="converting weights", unit="tensor",
                                      disable=None if progress is None else not progress, delay=1.0):
        tensor = gguf.tensor(gguf.expect_shape(names[name], shape).name)
        if module is None:
            state[name] = tensor
            continue
        prefix = name.rsplit(".", 1)[0]
        for key, value in type(module).from_float(tensor).state_dict().items():
            state[f"{prefix}.{key}"] = value
    return state
