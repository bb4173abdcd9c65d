"""GGUF -> config -> module for gemma3 and gemma4 files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf.io): metadata and the tensor table.
2. `Gemma3Config` / `Gemma4Config.from_gguf` (+ gemma4's `rope_freqs` factors when present)
   and a model on the meta device.
3. Weights: one typed tensor table per family (`verispec.gguf.table.Tensor`: GGUF name ->
   HF-style parameter name) handed to `verispec.gguf.load.plan_weights`, which checks every
   tensor's presence and shape, dequantises each to fp32 (in the gguf mode, Q4 linears take the
   stored blocks instead), converts linears to the chosen weight dtype (weights.quant; norms and
   scales stay fp32) and fills the module. A file with tensors the plan does not read is
   refused (errors.UnusedTensors).
   Dequantising Q4_K/Q5_0 and requantising takes seconds, so the converted state goes
   through `verispec.weight_cache` and the next load memory-maps it (the 270M: ~0.3 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).

With `shards` (one rank of a tensor-parallel group; gemma3 only) the same table is read through
`verispec.gguf.shard`: `splits(config)` says which tensors are cut and along which axis (whole
heads of q/k/v and o's columns, FFN features of gate/up and down's columns, vocabulary rows of the
embedding and output); the norms, q/k norms included, every rank reads whole.
"""
from __future__ import annotations

import os

import attrs
from verispec.errors import UnsupportedVariant
from verispec.gguf.io import GGUFFile, read_architecture
from verispec.gguf.load import Arch, load_trunk
from verispec.gguf.shard import Split
from verispec.gguf.table import Stack, Tensor
from verispec.nn.kv_cache import MAX_VERIFY_ROWS

from verispec_gemma4.modeling_gemma3 import Gemma3Config, Gemma3ForCausalLM
from verispec_gemma4.modeling_gemma4 import Gemma4Config, Gemma4ForCausalLM

__all__ = ["ARCHS", "DEFAULT_DTYPE", "GEMMA3_TENSORS", "GEMMA4_TENSORS", "ROPE_FREQS", "config_from_gguf", "load",
           "splits"]

#: weight dtype when the caller does not choose one. "gguf": the file's own blocks (Q4_K, Q5_0,
#: Q6_K, Q8_0 in the 270M) in the block kernel, nothing requantised, each Gemma 3 layer one C
#: call (weights.block_linear, nn.layers). Batch-invariant (a verify row is bitwise the one-row
#: decode) like int8, faster (43.0 vs 21.6 tok/s in paired rounds on a loaded host) and closer to
#: fp32 (argmax 97.9 vs 95.7 % of 326 teacher-forced rows): benchmarks/weight_modes.py, README
#: "Weight dtypes".
DEFAULT_DTYPE = "gguf"  # int8 where the C kernels are not built (weights.gguf_mode.default_dtype)

#: GGUF tensor -> parameter in our modules (HF's names); "{i}" = layer index (gemma4's "{e}" = expert).
#: gguf-py MODEL_TENSORS[GEMMA3]; docs/reference/gemma4.md §2.1 gives the HF <-> GGUF pairs.
#: `output.weight` is only in files with an untied LM head (a tied model has no lm_head entry).
#: The dense MLP's gate and up are one stacked linear (nn.mlp.GatedMLP).
GEMMA3_TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output.weight", "lm_head.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    Tensor("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Tensor("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    Tensor("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    Tensor("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    Tensor("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    Tensor("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    Tensor("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    Tensor("blk.{i}.post_attention_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Tensor("blk.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    Tensor(Stack("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"),
           "model.layers.{i}.mlp.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    Tensor("blk.{i}.post_ffw_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
)

#: gemma4 (llama.cpp src/models/gemma4 loader, gguf-py MODEL_TENSORS[GEMMA4]; docs/reference/gemma4.md §2.3):
#: every gemma3 row, plus per-layer embeddings, layer scalars, MoE. Norms are stored as w (no +1).
#: KV-shared layers have no attn_k/attn_v/attn_k_norm; full layers of K=V models no attn_v (the
#: model then builds no v_proj, so neither is looked up). The layer scalar and per-expert scales
#: are optional (the module's default, 1); experts come as one fused 3-D gate|up tensor or as
#: separate gate and up tensors.
GEMMA4_TENSORS = GEMMA3_TENSORS + (
    Tensor("per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"),
    Tensor("per_layer_model_proj.weight", "model.per_layer_model_projection.weight"),
    Tensor("per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight"),
    Tensor("blk.{i}.layer_output_scale.weight", "model.layers.{i}.layer_scalar", optional=True),
    Tensor("blk.{i}.inp_gate.weight", "model.layers.{i}.per_layer_input_gate.weight"),
    Tensor("blk.{i}.proj.weight", "model.layers.{i}.per_layer_projection.weight"),
    Tensor("blk.{i}.post_norm.weight", "model.layers.{i}.post_per_layer_input_norm.weight"),
    Tensor("blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.router.proj.weight"),
    Tensor("blk.{i}.ffn_gate_inp.scale", "model.layers.{i}.router.scale"),
    Tensor("blk.{i}.ffn_down_exps.scale", "model.layers.{i}.router.per_expert_scale", optional=True),
    Tensor("blk.{i}.pre_ffw_norm_2.weight", "model.layers.{i}.pre_feedforward_layernorm_2.weight"),
    Tensor("blk.{i}.post_ffw_norm_1.weight", "model.layers.{i}.post_feedforward_layernorm_1.weight"),
    Tensor("blk.{i}.post_ffw_norm_2.weight", "model.layers.{i}.post_feedforward_layernorm_2.weight"),
    Tensor("blk.{i}.ffn_gate_up_exps.weight", "model.layers.{i}.experts.gate_up_proj.{e}.weight",
           per_expert=True,
           alternatives=(Stack("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),)),
    Tensor("blk.{i}.ffn_down_exps.weight", "model.layers.{i}.experts.down_proj.{e}.weight", per_expert=True),
)


#: proportional RoPE's per-pair divisors: read into the config, not the state dict.
ROPE_FREQS = "rope_freqs.weight"

def splits(config: Gemma3Config) -> list[Split]:
    """The gemma3 tensors a tensor-parallel rank reads a slice of (torch order: axis 0 rows, -1
    columns); the rest (every norm) each rank reads whole."""
    c, dh = config, config.head_dim
    h, hkv = c.num_attention_heads, c.num_key_value_heads
    return [
        Split("blk.{i}.attn_q.weight", 0, h, dh), Split("blk.{i}.attn_k.weight", 0, hkv, dh),
        Split("blk.{i}.attn_v.weight", 0, hkv, dh), Split("blk.{i}.attn_output.weight", -1, h, dh),
        Split("blk.{i}.ffn_gate.weight", 0, c.intermediate_size), Split("blk.{i}.ffn_up.weight", 0, c.intermediate_size),
        Split("blk.{i}.ffn_down.weight", -1, c.intermediate_size),
        Split("token_embd.weight", 0, c.vocab_size), Split("output.weight", 0, c.vocab_size),
    ]


ARCHS = {
    "gemma3": Arch(lambda gguf: config_from_gguf(gguf), Gemma3ForCausalLM, GEMMA3_TENSORS, layout="gemma",
                   family="gemma3", default_dtype=DEFAULT_DTYPE),
    "gemma4": Arch(lambda gguf: config_from_gguf(gguf), Gemma4ForCausalLM, GEMMA4_TENSORS, layout="gemma",
                   family="gemma4", read_elsewhere={ROPE_FREQS}, default_dtype=DEFAULT_DTYPE),
}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, max_verify_rows: int = MAX_VERIFY_ROWS,
         use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None, shards=None) -> Gemma3ForCausalLM | Gemma4ForCausalLM:
    """Load a gemma3 or gemma4 GGUF as a `Gemma3ForCausalLM` / `Gemma4ForCausalLM` trunk
    (verispec.gguf.load.load_trunk).

    Returns the trunk in eval mode: linears in `dtype` (weights.quant), norms, scales and scalars
    fp32; `.tokenizer` set from the file's metadata when `tokenizer` is true.
    dtype: "gguf" (default) | "int8" | "bfloat16"/"bf16" | "float32"/"fp32" | "int4".
    context_length: max positions (default: the file's context_length).
    max_rows_per_forward, max_verify_rows: chunk length and ring slack (see Gemma3ForCausalLM).
    use_cache: read/write converted weights under verispec's cache dir.
    progress: tqdm bar while converting (None: on a terminal, after a second).
    shards: one rank of a tensor-parallel group (verispec.nn.parallel.Shards): the rank's slices
      only (verispec.gguf.load.load_trunk's shards); gemma3 only (a gemma4 file raises
      errors.UnsupportedVariant); raises nn.parallel.HeadsNotDivisible.
    Threads are the caller's (`verispec.api.load_registered_trunk` sets them).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.UnsupportedArchitecture,
    errors.DamagedFile, errors.UnusedTensors (a file holding tensors the math would not use, listed),
    weights.quant.UnknownWeightDtype.
    """
    if shards is not None and (arch := read_architecture(path)) != "gemma3":
        raise UnsupportedVariant(os.fspath(path), f"tensor parallelism (--tp {shards.world_size}) of a {arch} file",
                                 "only gemma3 trunks have a tensor-parallel form yet; leave --tp out")
    return load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                      shards=shards, splits=splits, context_length=context_length, max_rows_per_forward=max_rows_per_forward,
                      max_verify_rows=max_verify_rows)


def config_from_gguf(gguf: GGUFFile) -> Gemma3Config | Gemma4Config:
    """The config of an opened gemma3 / gemma4 GGUF, with gemma4's `rope_freqs` factors when the
    file has them."""
    shapes = {name: gguf.tensor_info(name).shape for name in gguf}
    if gguf.architecture == "gemma3":
        return Gemma3Config.from_gguf(gguf.metadata, shapes, source=gguf.path)
    config = Gemma4Config.from_gguf(gguf.metadata, shapes, source=gguf.path)
    if ROPE_FREQS in gguf:
        gguf.expect_shape(ROPE_FREQS, (config.global_head_dim // 2,))
        config = attrs.evolve(config, full_rope_freq_factors=tuple(gguf.tensor(ROPE_FREQS).tolist()))
    return config
