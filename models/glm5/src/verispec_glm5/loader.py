"""GGUF -> config -> module for glm4moe files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf.io): metadata and the tensor table.
2. `Glm4MoeConfig.from_gguf`: sizes from `glm4moe.*` keys (docs/reference/glm5-nemotron.md §3.2); the
   trunk is block_count - nextn_predict_layers layers, the first leading_dense_block_count dense.
3. Weights: one typed tensor table (`LAYER_TENSORS`, GGUF name -> HF-style parameter name) through
   `verispec.gguf.load.load_trunk`; the NextN block `blk.{L}` maps onto `mtp.*` with the same
   per-layer rows plus its nextn.* tensors (`nextn_tensors`). Values are taken as stored (plain
   norm weights, unpermuted q/k rows). A file with tensors the plan does not read is refused
   (errors.UnusedTensors).
4. The NextN draft head (`draft_head.Glm4MoeNextNHead`) when the file holds a NextN block.
5. The tokenizer from the file's own metadata.
"""
from __future__ import annotations

import os

from verispec.gguf.io import GGUFFile
from verispec.gguf.load import Arch, load_trunk
from verispec.gguf.table import Stack, Tensor

from verispec_glm5.modeling_glm4moe import ARCHITECTURES, Glm4MoeConfig, Glm4MoeForCausalLM, check_file_kind

__all__ = ["ARCHS", "DEFAULT_DTYPE", "LAYER_TENSORS", "TENSORS", "config_from_gguf", "load", "nextn_tensors", "with_nextn"]

#: int8 weight-only: batch-invariant (a verify row is bitwise the one-row decode).
DEFAULT_DTYPE = "int8"

_L = "model.layers.{i}."
#: per-layer rows, shared by the trunk ("{i}") and the NextN block (`nextn_tensors`).
LAYER_TENSORS = (
    Tensor("blk.{i}.attn_norm.weight", _L + "input_layernorm.weight"),
    Tensor("blk.{i}.post_attention_norm.weight", _L + "post_attention_layernorm.weight"),
    # q|k|v as one linear (separate tensors stacked, or llama.cpp's fused attn_qkv)
    Tensor(Stack("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
           _L + "self_attn.qkv_proj.weight", alternatives=("blk.{i}.attn_qkv.weight",)),
    Tensor(Stack("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias"),
           _L + "self_attn.qkv_bias", alternatives=("blk.{i}.attn_qkv.bias",)),
    Tensor("blk.{i}.attn_output.weight", _L + "self_attn.o_proj.weight"),
    Tensor("blk.{i}.attn_q_norm.weight", _L + "self_attn.q_norm.weight"),
    Tensor("blk.{i}.attn_k_norm.weight", _L + "self_attn.k_norm.weight"),
    # dense SwiGLU (gate|up one stacked linear: nn.mlp.GatedMLP)
    Tensor(Stack("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"), _L + "mlp.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down.weight", _L + "mlp.down_proj.weight"),
    # MoE: router and its selection bias, experts (gate|up stacked per expert), shared expert
    Tensor("blk.{i}.ffn_gate_inp.weight", _L + "mlp.gate.weight"),
    Tensor("blk.{i}.exp_probs_b.bias", _L + "mlp.gate.e_score_correction_bias"),
    Tensor(Stack("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
           _L + "mlp.experts.{e}.gate_up_proj.weight", per_expert=True),
    Tensor("blk.{i}.ffn_down_exps.weight", _L + "mlp.experts.{e}.down_proj.weight", per_expert=True),
    Tensor(Stack("blk.{i}.ffn_gate_shexp.weight", "blk.{i}.ffn_up_shexp.weight"),
           _L + "mlp.shared_experts.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down_shexp.weight", _L + "mlp.shared_experts.down_proj.weight"),
)

#: GGUF tensor -> parameter in our modules. Entries the model does not have are never looked up
#: (`output.weight` when tied, q/k norms and biases where the file has none, MoE rows on dense layers).
TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output.weight", "lm_head.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    *LAYER_TENSORS,
)


def nextn_tensors(n: int, layer_tensors: tuple[Tensor, ...] = LAYER_TENSORS) -> tuple[Tensor, ...]:
    """The NextN block `blk.{n}` (n = trunk layer count) onto `mtp.*` (docs/reference/glm5-nemotron.md
    §3.3, §5.3, §6.4): its nextn.* tensors, and its decoder layer with the trunk's per-layer rows
    (`layer_tensors`, parameters under `model.layers.{i}.`) as `mtp.mtp_block.*`. glm-dsa and
    glm5-next pass their own rows (`layer_rows`); only those their block has are looked up."""
    def at(source):
        if isinstance(source, str):
            return source.format(i=n)
        return Stack(*(p.format(i=n) for p in source.parts))

    def one(t: Tensor) -> Tensor:
        return Tensor(at(t.source), t.state_name.replace(_L, "mtp.mtp_block."),
                      alternatives=tuple(at(a) for a in t.alternatives), per_expert=t.per_expert)
    b = f"blk.{n}.nextn."
    return (
        Tensor(b + "eh_proj.weight", "mtp.eh_proj.weight"),
        Tensor(b + "enorm.weight", "mtp.enorm.weight"),
        Tensor(b + "hnorm.weight", "mtp.hnorm.weight"),
        # absent: llama.cpp falls back to output_norm (and to token_embd / output for the two below)
        Tensor(b + "shared_head_norm.weight", "mtp.post_norm.weight", alternatives=("output_norm.weight",)),
        Tensor(b + "embed_tokens.weight", "mtp.embed_tokens.weight"),
        Tensor(b + "shared_head_head.weight", "mtp.shared_head.weight"),
        *(one(t) for t in layer_tensors),
    )


def layer_rows(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The per-layer rows of a trunk table (parameters under `model.layers.{i}.`)."""
    return tuple(t for t in tensors if t.state_name.startswith(_L))


def with_nextn(tensors: tuple[Tensor, ...]):
    """main_tensors(config) for a trunk table: `tensors`, and the NextN block's rows
    (`nextn_tensors` over the table's per-layer rows) when the file has one."""
    layers = layer_rows(tensors)

    def main_tensors(config) -> tuple[Tensor, ...]:
        return tensors + (nextn_tensors(config.num_hidden_layers, layers) if config.num_nextn_predict_layers else ())

    return main_tensors


#: a glm4moe file's table
main_tensors = with_nextn(TENSORS)


ARCHS = {name: Arch(lambda gguf: config_from_gguf(gguf), Glm4MoeForCausalLM, main_tensors, layout="glm4moe",
                    family=name, default_dtype=DEFAULT_DTYPE,
                    check_kind=lambda gguf: check_file_kind(gguf.metadata, gguf, source=gguf.path),
                    draft_head="mtp.")
         for name in ARCHITECTURES}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None) -> Glm4MoeForCausalLM:
    """Load a glm4moe GGUF as a `Glm4MoeForCausalLM` trunk (verispec.gguf.load.load_trunk), with
    `.draft_head` when the file holds a NextN block.

    dtype: "int8" (default) | "bfloat16" | "float32" | "int4" | "gguf" (linears; everything else fp32).
    context_length: max positions (default: the file's context_length).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.UnsupportedArchitecture,
    errors.DamagedFile, errors.UnusedTensors (a file holding tensors the math would not use, listed),
    UnsupportedGlm4MoeVariant (softmax gating, M-RoPE, several NextN blocks, an MTP-only file, ...),
    weights.quant.UnknownWeightDtype.
    """
    model = load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                       context_length=context_length, max_rows_per_forward=max_rows_per_forward)
    if model.config.num_nextn_predict_layers:
        from verispec_glm5.draft_head import Glm4MoeNextNHead

        model.draft_head = Glm4MoeNextNHead(model)
    return model


def config_from_gguf(gguf: GGUFFile) -> Glm4MoeConfig:
    """The config of an opened glm4moe GGUF (`Glm4MoeConfig.from_gguf`)."""
    return Glm4MoeConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                   source=gguf.path)
