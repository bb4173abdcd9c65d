"""GGUF -> config -> module for gemma3 and gemma4 files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TargetSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf_io): metadata and the tensor table.
2. `Gemma3Config` / `Gemma4Config.from_gguf_metadata` and a model on the meta device.
3. Weights: one typed tensor table per family (`verispec.gguf_load.Tensor`: GGUF name ->
   HF-style parameter name) handed to `verispec.gguf_load.plan_weights`, which checks every
   tensor's presence and shape, dequantises each to fp32 (in the gguf mode, Q4 linears take the
   stored blocks instead), converts linears to the chosen weight dtype (weights.quant; norms and
   scales stay fp32) and fills the module.
   Dequantising Q4_K/Q5_0 and requantising takes seconds, so the converted state goes
   through `verispec.weight_cache` and the next load memory-maps it (the 270M: ~0.3 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).
"""
from __future__ import annotations

import os

import attrs
from verispec.gguf_io import GGUFFile
from verispec.gguf_load import Stack, Tensor, plan_weights
from verispec.weights.gguf_mode import default_dtype
from verispec.weights.quant import canonical_dtype
from verispec.nn.kv_cache import MAX_VERIFY_ROWS

from verispec_gemma4.modeling_gemma3 import Gemma3Config, Gemma3ForCausalLM
from verispec_gemma4.modeling_gemma4 import Gemma4Config, Gemma4ForCausalLM

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


class UnsupportedArchitecture(ValueError):
    def __init__(self, path: str, architecture: str):
        self.path, self.architecture = path, architecture
        super().__init__(f"{path} is a {architecture!r} GGUF; verispec-gemma4 loads 'gemma3' and 'gemma4' files")


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, max_verify_rows: int = MAX_VERIFY_ROWS,
         use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None) -> Gemma3ForCausalLM | Gemma4ForCausalLM:
    """Load a gemma3 or gemma4 GGUF as a `Gemma3ForCausalLM` / `Gemma4ForCausalLM` trunk.

    Returns the trunk in eval mode: linears in `dtype` (weights.quant), norms, scales and scalars
    fp32; `.tokenizer` set from the file's metadata when `tokenizer` is true.
    dtype: "gguf" (default) | "int8" | "bfloat16"/"bf16" | "float32"/"fp32" | "int4".
    context_length: max positions (default: the file's context_length).
    max_rows_per_forward, max_verify_rows: chunk length and ring slack (see Gemma3ForCausalLM).
    use_cache: read/write converted weights under verispec's cache dir.
    progress: tqdm bar while converting (None: on a terminal, after a second).
    Threads are the caller's (`verispec.api.load_target` sets them).
    Raises gguf_io errors (MissingKey, MissingTensor, BadTensorShape, ...), UnsupportedArchitecture,
    weights.quant.UnknownWeightDtype.
    """
    path = os.fspath(path)
    dtype = canonical_dtype(dtype or default_dtype(DEFAULT_DTYPE))
    gguf = GGUFFile.open(path)
    arch = gguf.architecture
    options = {"dtype": dtype, "context_length": context_length, "max_rows_per_forward": max_rows_per_forward,
                   "max_verify_rows": max_verify_rows}
    if arch == "gemma3":
        config = Gemma3Config.from_gguf_metadata(gguf.metadata, vocab_size=_rows(gguf, "token_embd.weight"),
                                                 tie_word_embeddings="output.weight" not in gguf)
        model, table = Gemma3ForCausalLM(config, **options), GEMMA3_TENSORS
    elif arch == "gemma4":
        config = _gemma4_config(gguf)
        model, table = Gemma4ForCausalLM(config, **options), GEMMA4_TENSORS
    else:
        raise UnsupportedArchitecture(path, arch)
    plan = plan_weights(gguf, model, table, num_layers=config.num_hidden_layers,
                        num_experts=getattr(config, "num_experts", 0))
    plan.load(dtype=dtype, layout="gemma", use_cache=use_cache, progress=progress)
    if tokenizer:
        from verispec.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_gguf(gguf)
    return model


def _rows(gguf: GGUFFile, name: str) -> int:
    return gguf.tensor_info(name).shape[0]


def _gemma4_config(gguf: GGUFFile) -> Gemma4Config:
    """Metadata plus what only the tensor table says (vocab sizes, rope_freqs, K=V, tying)."""
    config = Gemma4Config.from_gguf_metadata(gguf.metadata, vocab_size=_rows(gguf, "token_embd.weight"))
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention" and i < config.first_kv_shared_layer]
    return attrs.evolve(
        config,
        full_rope_freq_factors=tuple(gguf.tensor("rope_freqs.weight").tolist()) if "rope_freqs.weight" in gguf else None,
        vocab_size_per_layer_input=_rows(gguf, "per_layer_token_embd.weight") if "per_layer_token_embd.weight" in gguf else 0,
        attention_k_eq_v=bool(full) and f"blk.{full[0]}.attn_v.weight" not in gguf,
        tie_word_embeddings="output.weight" not in gguf,
    )
