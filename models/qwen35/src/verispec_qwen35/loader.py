"""GGUF -> config -> module for qwen35 / qwen35moe files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf.io): metadata and the tensor table.
2. `Qwen35Config.from_gguf`: sizes from `{arch}.*` keys (docs/reference/qwen35.md §2); the main
   stack is block_count - nextn_predict_layers; layer types from `attention.recurrent_layers`
   when the file has it, else the `full_attention_interval` rule.
3. Weights: one typed tensor table (`TENSORS`, GGUF name -> HF-style parameter name) through
   `verispec.gguf.load.load_trunk`; the MTP block `blk.{L}` maps onto `mtp.*` with the same
   per-layer rows (`mtp_tensors`). Values are taken as the converter wrote them: norms already
   hold 1 + w (except ssm_norm), ssm_a holds -exp(A_log), value heads are re-tiled; the
   modeling file applies the matching math, so nothing is transformed here.
   A file with tensors the plan does not read is refused (errors.UnusedTensors).
4. The MTP draft head (`draft_head.Qwen35MtpHead`) when the file holds an MTP block, or from a
   standalone MTP file paired with the main one (`load_mtp_file`, the `--draft-model` loader).
5. The tokenizer from the file's own metadata.
"""
from __future__ import annotations

import os

import attrs
from verispec.errors import UnusedTensors
from verispec.gguf.io import GGUFFile
from verispec.gguf.load import Arch, load_trunk, plan_weights
from verispec.gguf.table import Stack, Tensor

from verispec_qwen35.modeling_qwen35 import (ARCHITECTURES, Qwen35Config, Qwen35ForCausalLM,
                                             UnsupportedQwen35Variant, check_file_kind)

__all__ = ["ARCHS", "DEFAULT_DTYPE", "TENSORS", "config_from_gguf", "load", "load_mtp_file", "main_tensors",
           "mtp_tensors"]

#: int8 weight-only: batch-invariant (a verify row is bitwise the one-row decode).
DEFAULT_DTYPE = "int8"

_L = "model.layers.{i}."
#: per-layer rows, shared by the main stack ("{i}") and the MTP block (`mtp_tensors`).
LAYER_TENSORS = (
    Tensor("blk.{i}.attn_norm.weight", _L + "input_layernorm.weight"),
    Tensor("blk.{i}.post_attention_norm.weight", _L + "post_attention_layernorm.weight"),
    # gated full attention (q and its output gate interleaved per head in attn_q)
    Tensor("blk.{i}.attn_q.weight", _L + "self_attn.q_proj.weight"),
    Tensor("blk.{i}.attn_k.weight", _L + "self_attn.k_proj.weight"),
    Tensor("blk.{i}.attn_v.weight", _L + "self_attn.v_proj.weight"),
    Tensor("blk.{i}.attn_output.weight", _L + "self_attn.o_proj.weight"),
    Tensor("blk.{i}.attn_q_norm.weight", _L + "self_attn.q_norm.weight"),
    Tensor("blk.{i}.attn_k_norm.weight", _L + "self_attn.k_norm.weight"),
    # GatedDeltaNet (value heads in tiled order)
    Tensor("blk.{i}.attn_qkv.weight", _L + "linear_attn.in_proj_qkv.weight"),
    Tensor("blk.{i}.attn_gate.weight", _L + "linear_attn.in_proj_z.weight"),
    Tensor("blk.{i}.ssm_beta.weight", _L + "linear_attn.in_proj_b.weight"),
    Tensor("blk.{i}.ssm_alpha.weight", _L + "linear_attn.in_proj_a.weight"),
    Tensor("blk.{i}.ssm_conv1d.weight", _L + "linear_attn.conv1d_weight"),
    Tensor("blk.{i}.ssm_dt.bias", _L + "linear_attn.dt_bias"),
    Tensor("blk.{i}.ssm_a", _L + "linear_attn.ssm_a"),
    Tensor("blk.{i}.ssm_norm.weight", _L + "linear_attn.norm.weight"),
    Tensor("blk.{i}.ssm_out.weight", _L + "linear_attn.out_proj.weight"),
    # dense SwiGLU (gate|up one stacked linear: nn.mlp.GatedMLP)
    Tensor(Stack("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"), _L + "mlp.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down.weight", _L + "mlp.down_proj.weight"),
    # MoE: router, experts (gate|up fused, or separate), shared expert and its gate vector
    Tensor("blk.{i}.ffn_gate_inp.weight", _L + "mlp.gate.weight"),
    Tensor("blk.{i}.ffn_gate_up_exps.weight", _L + "mlp.gate_up_proj.{e}.weight", per_expert=True,
           alternatives=(Stack("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),)),
    Tensor("blk.{i}.ffn_down_exps.weight", _L + "mlp.down_proj.{e}.weight", per_expert=True),
    Tensor("blk.{i}.ffn_gate_inp_shexp.weight", _L + "mlp.shared_expert_gate"),
    Tensor(Stack("blk.{i}.ffn_gate_shexp.weight", "blk.{i}.ffn_up_shexp.weight"),
           _L + "mlp.shared_expert.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down_shexp.weight", _L + "mlp.shared_expert.down_proj.weight"),
)

#: GGUF tensor -> parameter in our modules. Entries the model does not have are never looked up
#: (`output.weight` when tied, attention rows on GDN layers, MoE rows on dense files, ...).
TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output.weight", "lm_head.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    *LAYER_TENSORS,
)


def mtp_tensors(n: int) -> tuple[Tensor, ...]:
    """The MTP block `blk.{n}` (n = main layer count) onto `mtp.*` (docs/reference/qwen35.md §3.7)."""
    def at(source):
        if isinstance(source, str):
            return source.format(i=n)
        return Stack(*(p.format(i=n) for p in source.parts))

    def one(t: Tensor) -> Tensor:
        return Tensor(at(t.source), t.state_name.replace(_L, "mtp.layer."),
                      alternatives=tuple(at(a) for a in t.alternatives), per_expert=t.per_expert)
    b = f"blk.{n}.nextn."
    return (
        Tensor(b + "eh_proj.weight", "mtp.fc.weight"),
        Tensor(b + "enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
        Tensor(b + "hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
        Tensor(b + "shared_head_norm.weight", "mtp.norm.weight", alternatives=("output_norm.weight",)),
        *(one(t) for t in LAYER_TENSORS),
    )


def main_tensors(config: Qwen35Config) -> tuple[Tensor, ...]:
    """A main file's table: `TENSORS`, and the MTP block's rows when the file has one."""
    return TENSORS + (mtp_tensors(config.num_hidden_layers) if config.num_mtp_layers else ())


ARCHS = {name: Arch(lambda gguf: config_from_gguf(gguf), Qwen35ForCausalLM, main_tensors, layout="qwen35",
                   family=name, check_kind=lambda gguf: check_file_kind(gguf, source=gguf.path),
                   default_dtype=DEFAULT_DTYPE, draft_head="mtp.")
         for name in ARCHITECTURES}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None, chunked_prefill_min_rows: int | None = None) -> Qwen35ForCausalLM:
    """Load a qwen35 / qwen35moe GGUF as a `Qwen35ForCausalLM` trunk (verispec.gguf.load.load_trunk),
    with `.draft_head` when the file holds an MTP block.

    dtype: "int8" (default) | "bfloat16" | "float32" | "int4" (linears; everything else fp32).
    context_length: max positions (default: the file's context_length).
    chunked_prefill_min_rows: see Qwen35ForCausalLM (default None: the exact row loop only).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.UnsupportedArchitecture,
    errors.DamagedFile, errors.UnusedTensors (a file holding tensors the math would not use, listed),
    UnsupportedQwen35Variant (qwen3next layouts, a standalone MTP file), weights.quant.UnknownWeightDtype.
    """
    model = load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                       context_length=context_length, max_rows_per_forward=max_rows_per_forward,
                       chunked_prefill_min_rows=chunked_prefill_min_rows)
    if model.config.num_mtp_layers:
        from verispec_qwen35.draft_head import Qwen35MtpHead

        model.draft_head = Qwen35MtpHead(model)
    return model


def load_mtp_file(path: str | os.PathLike, trunk, *, use_cache: bool = True):
    """A standalone MTP GGUF (docs/reference/qwen35.md §3.7, variant 3) as the draft head of `trunk`,
    the `DraftFileSpec` loader behind `--draft-model` for qwen35 / qwen35moe files.

    The block is loaded in the trunk's weight dtype; the head reads the trunk's embedding and LM
    head (the file's copies of token_embd / output are not read). Returns a `Qwen35MtpHead`.
    Raises UnsupportedQwen35Variant (not an MTP-only file, or `trunk` is not a qwen35 trunk, or
    its config differs from the file's: the fields are named), errors.UnusedTensors (tensors a head
    does not read: dedicated MTP embeddings, scale sidecars), verispec.gguf.errors for a broken file,
    errors.DamagedFile (a tensor holding a NaN or an infinity: the file and the tensor are named).
    """
    from torch import nn
    from verispec.weights.quant import swap_linears

    from verispec_qwen35.draft_head import Qwen35MtpHead
    from verispec_qwen35.modeling_qwen35 import Qwen35Mtp

    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf, standalone_mtp=True)
    if not isinstance(trunk, Qwen35ForCausalLM):
        raise UnsupportedQwen35Variant(path, f"a qwen35 MTP head, but the model is {type(trunk).__name__}",
                                       "load the main GGUF this MTP file was converted with")
    main = attrs.asdict(trunk.config)
    differ = [name for name, value in attrs.asdict(config).items()
              if name not in _PER_FILE_FIELDS and main[name] != value]
    if differ:
        what = ", ".join(f"{name} {getattr(config, name)!r} (trunk {main[name]!r})" for name in differ[:4])
        raise UnsupportedQwen35Variant(path, f"an MTP head for another trunk: {what}",
                                       "pass the MTP file converted with the same checkpoint as --model")
    holder = nn.Module()  # state names "mtp.*", as in a main file's table
    holder.mtp = Qwen35Mtp(config, device="meta")
    swap_linears(holder, trunk.dtype)
    plan = plan_weights(gguf, holder, mtp_tensors(config.num_hidden_layers), num_layers=config.num_hidden_layers,
                        num_experts=config.num_experts)
    unused = plan.unused_tensors(read_elsewhere=_READ_FROM_TRUNK)
    if unused:
        raise UnusedTensors(path, f"{config.architecture} MTP head", unused)
    plan.load(dtype=trunk.dtype, layout="qwen35-mtp", use_cache=use_cache, progress=False, finite=True)
    return Qwen35MtpHead(trunk, mtp=holder.mtp)


#: config fields a standalone MTP file may state differently from its main file.
_PER_FILE_FIELDS = {"num_mtp_layers", "tie_word_embeddings", "shared_expert_gate_shape"}
#: a standalone MTP file's copies of the trunk's tensors: the head reads the trunk's instead.
_READ_FROM_TRUNK = ("token_embd.weight", "output.weight", "output_norm.weight")


def config_from_gguf(gguf: GGUFFile, *, standalone_mtp: bool = False) -> Qwen35Config:
    """The config of an opened qwen35 / qwen35moe GGUF (`Qwen35Config.from_gguf`)."""
    return Qwen35Config.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                  source=gguf.path, standalone_mtp=standalone_mtp)
