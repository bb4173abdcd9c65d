"""GGUF -> config -> module for llama and qwen2 files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf.io): metadata and the tensor table.
2. `LlamaConfig.from_gguf` (+ the `rope_freqs` factors when present) and a model on the
   meta device.
3. Weights: one typed tensor table (`verispec.gguf.table.Tensor`: GGUF name -> HF parameter
   name) handed to `verispec.gguf.load.plan_weights`, which checks every tensor's presence and
   shape, dequantises each to fp32 (in the gguf mode, Q4 linears take the stored blocks
   instead), converts linears to the module's weight dtype (weights.quant; norms and biases stay
   fp32) and fills the module. A file with tensors the plan does not
   read is refused (errors.UnusedTensors). Q/K rows are taken as the file holds them
   (llama's are permuted by llama.cpp's converter); `modeling_llama` applies the matching RoPE
   pairing, so nothing is un-permuted here.
   Dequantising and requantising takes seconds (SmolLM2 ~8 s, Qwen2.5-Coder-0.5B ~30 s), so
   the converted state goes through `verispec.weight_cache` and the next load memory-maps
   it (SmolLM2: ~0.5 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).

With `shards` (one rank of a tensor-parallel group) the same table is read through
`verispec.gguf.shard`: `splits(config)` says which tensors are cut and along which axis (whole
heads of q/k/v and o's columns, FFN features of gate/up and down's columns, vocabulary rows of the
embedding and output), so a rank reads only its slices.
"""
from __future__ import annotations

import os

import attrs
from verispec.gguf.io import GGUFFile
from verispec.gguf.load import Arch, load_trunk
from verispec.gguf.shard import Split
from verispec.gguf.table import Stack, Tensor

from verispec_llama.modeling_llama import LlamaConfig, LlamaForCausalLM

__all__ = ["ARCHS", "DEFAULT_DTYPE", "ROPE_FREQS", "TENSORS", "config_from_gguf", "load", "splits"]

#: weight dtype when the caller does not choose one. "gguf": the file's own blocks (Q4_0 ... Q8_0)
#: in the block kernel, nothing requantised, each layer one C call (weights.block_linear, nn.layers).
#: Batch-invariant (a verify row is bitwise the one-row decode) like int8, and faster and closer
#: to fp32: SmolLM2-135M 138 vs 62 tok/s, argmax = fp32 97.9 vs 97.3 %; Qwen2.5-Coder-0.5B 51 vs
#: 30 tok/s, 100.0 vs 98.3 % (benchmarks/weight_modes.py, docs/benchmarks.md "Weight modes").
DEFAULT_DTYPE = "gguf"  # int8 where the C kernels are not built (weights.gguf_mode.default_dtype)

#: GGUF tensor -> parameter in our modules (HF's names); "{i}" = layer index.
#: gguf-py MODEL_TENSORS[LLAMA] / [QWEN2]. q|k|v and gate|up are stacked into one linear each
#: (modeling_llama; in the gguf mode parts of mixed classes, e.g. a Q4_K attn_q beside a Q6_K
#: attn_v, run as one linear per run of one class: weights.quant.PartwiseLinear). Entries the model
#: does not have are not looked up: `output.weight` only for an untied LM head, the q/k/v
#: biases for qwen2 and llama with attention_bias, the output bias for llama with
#: attention_out_bias (LlamaConfig.from_gguf).
TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output.weight", "lm_head.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    Tensor("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Tensor(Stack("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
           "model.layers.{i}.self_attn.qkv_proj.weight"),
    Tensor("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    Tensor(Stack("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias"),
           "model.layers.{i}.self_attn.qkv_bias"),
    Tensor("blk.{i}.attn_output.bias", "model.layers.{i}.self_attn.o_bias"),
    Tensor("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Tensor(Stack("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"),
           "model.layers.{i}.mlp.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
)
#: llama3-style frequency factors: read into the config, not the state dict.
ROPE_FREQS = "rope_freqs.weight"




def splits(config: LlamaConfig) -> list[Split]:
    """The tensors a tensor-parallel rank reads a slice of (torch order: axis 0 rows, -1 columns);
    the rest (norms, rope_freqs, the o bias, added after the all-reduce) every rank reads whole."""
    c, dh = config, config.head_dim
    h, hkv = c.num_attention_heads, c.num_key_value_heads
    return [
        Split("blk.{i}.attn_q.weight", 0, h, dh), Split("blk.{i}.attn_q.bias", 0, h, dh),
        Split("blk.{i}.attn_k.weight", 0, hkv, dh), Split("blk.{i}.attn_k.bias", 0, hkv, dh),
        Split("blk.{i}.attn_v.weight", 0, hkv, dh), Split("blk.{i}.attn_v.bias", 0, hkv, dh),
        Split("blk.{i}.attn_output.weight", -1, h, dh),
        Split("blk.{i}.ffn_gate.weight", 0, c.intermediate_size), Split("blk.{i}.ffn_up.weight", 0, c.intermediate_size),
        Split("blk.{i}.ffn_down.weight", -1, c.intermediate_size),
        Split("token_embd.weight", 0, c.vocab_size), Split("output.weight", 0, c.vocab_size),
    ]


ARCHS = {name: Arch(lambda gguf: config_from_gguf(gguf), LlamaForCausalLM, TENSORS, layout="llama", family="llama/qwen2",
                   read_elsewhere={ROPE_FREQS}, default_dtype=DEFAULT_DTYPE) for name in ("llama", "qwen2")}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None, shards=None) -> LlamaForCausalLM:
    """Load a llama or qwen2 GGUF as a `LlamaForCausalLM` trunk (verispec.gguf.load.load_trunk).

    Returns the trunk in eval mode: linears in `dtype` (weights.quant), norms and biases fp32;
    `.tokenizer` set from the file's metadata when `tokenizer` is true.
    dtype: "gguf" (default) | "int8" | "bfloat16"/"bf16" | "float32"/"fp32" | "int4".
    context_length: max positions (default: the file's context_length).
    max_rows_per_forward: forward chunk (default: weights.quant.rows_per_forward(dtype)).
    use_cache: read/write converted weights under verispec's cache dir.
    progress: tqdm bar while converting (None: on a terminal, after a second).
    shards: one rank of a tensor-parallel group (verispec.nn.parallel.Shards): the rank's slices
      only (verispec.gguf.load.load_trunk's shards); raises nn.parallel.HeadsNotDivisible.
    Threads are the caller's (`verispec.api.load_registered_trunk` sets them).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.DamagedFile,
    errors.UnusedTensors (a file holding tensors the math would not use, listed),
    UnsupportedLlamaVariant, weights.quant.UnknownWeightDtype.
    """
    return load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                      shards=shards, splits=splits, context_length=context_length,
                      max_rows_per_forward=max_rows_per_forward)


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    """The config of an opened GGUF, with the `rope_freqs` factors when the file has them."""
    config = LlamaConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                   source=gguf.path)
    if ROPE_FREQS in gguf:
        gguf.expect_shape(ROPE_FREQS, (config.rotary_dim // 2,))
        config = attrs.evolve(config, rope_freq_factors=tuple(gguf.tensor(ROPE_FREQS).tolist()))
    return config
