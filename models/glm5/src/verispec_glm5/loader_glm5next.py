"""GGUF -> config -> module for glm5-next files (GLM-5.3-Flash; `glm5next` too): I/O only.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader: `Glm5NextConfig.from_gguf`
(docs/reference/glm5-nemotron.md §6.3), then `TENSORS` through `verispec.gguf.load.load_trunk`
(values as stored: `ssm_a` = -exp(A_log), plain norm weights, k_b / v_b in llama.cpp's per-head
split, §6.4). KDA rows are looked up on KDA layers only, MLA and indexer rows on MLA layers. The
NextN block `blk.{L}` maps onto `mtp.*` (`loader.nextn_tensors`) and becomes the trunk's `draft_head`. A
file holding other tensors the math would not use is refused (errors.UnusedTensors).
"""
from __future__ import annotations

import os

from verispec.gguf.io import GGUFFile
from verispec.gguf.load import Arch, load_trunk
from verispec.gguf.table import Stack, Tensor

from verispec_glm5.loader import with_nextn
from verispec_glm5.loader_glm_dsa import TENSORS as GLM_DSA_TENSORS
from verispec_glm5.modeling_glm4moe import check_file_kind
from verispec_glm5.modeling_glm5next import ARCHITECTURES, Glm5NextConfig, Glm5NextForCausalLM

__all__ = ["ARCHS", "DEFAULT_DTYPE", "TENSORS", "load"]

#: int8 weight-only: batch-invariant (a verify row is bitwise the one-row decode).
DEFAULT_DTYPE = "int8"

_L = "model.layers.{i}."
_A = _L + "self_attn."
#: GGUF tensor -> parameter; entries the model does not have are never looked up.
TENSORS = (
    *GLM_DSA_TENSORS,  # embedding, head, norms, MLA + indexer, dense and MoE FFN
    Tensor("blk.{i}.indexer_compressor_gate.weight", _A + "indexer.compress_gate.weight"),
    Tensor("blk.{i}.indexer_compressor_ape.weight", _A + "indexer.compress_ape"),
    # KDA
    Tensor(Stack("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
           _A + "qkv_proj.weight"),
    Tensor(Stack("blk.{i}.ssm_conv1d_q.weight", "blk.{i}.ssm_conv1d_k.weight", "blk.{i}.ssm_conv1d_v.weight"),
           _A + "conv1d_weight"),
    Tensor("blk.{i}.ssm_f_a.weight", _A + "f_a_proj.weight"),
    Tensor("blk.{i}.ssm_f_b.weight", _A + "f_b_proj.weight"),
    Tensor("blk.{i}.ssm_dt.bias", _A + "dt_bias"),
    Tensor("blk.{i}.ssm_a", _A + "ssm_a"),
    Tensor("blk.{i}.ssm_beta.weight", _A + "b_proj.weight"),
    Tensor("blk.{i}.ssm_g_a.weight", _A + "g_a_proj.weight"),
    Tensor("blk.{i}.ssm_g_b.weight", _A + "g_b_proj.weight"),
    Tensor("blk.{i}.ssm_norm.weight", _A + "o_norm.weight"),
    # mHC
    *(Tensor(f"blk.{{i}}.hc_{part}_{name}.weight", _L + f"{part}_hc.{name}")
      for part in ("attn", "ffn") for name in ("fn", "base", "scale")),
)


#: a file's table: `TENSORS`, and the NextN block's rows when the file has one
main_tensors = with_nextn(TENSORS)


ARCHS = {name: Arch(lambda gguf: config_from_gguf(gguf), Glm5NextForCausalLM, main_tensors,
                    layout="glm5-next", family=name, default_dtype=DEFAULT_DTYPE,
                    check_kind=lambda gguf: check_file_kind(gguf.metadata, gguf, source=gguf.path),
                    draft_head="mtp.")
         for name in ARCHITECTURES}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None) -> Glm5NextForCausalLM:
    """Load a glm5-next / glm5next GGUF as a `Glm5NextForCausalLM` trunk (verispec.gguf.load.load_trunk),
    with `.draft_head` when the file holds a NextN block.

    dtype: "int8" (default) | "bfloat16" | "float32" | "int4" | "gguf" (linears; everything else fp32).
    context_length: max positions (default: the file's context_length).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.UnsupportedArchitecture,
    errors.DamagedFile, errors.UnusedTensors, UnsupportedGlm4MoeVariant (RoPE dims, softmax gating,
    a shared indexer layer, HC other than 4, ...), weights.quant.UnknownWeightDtype.
    """
    model = load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                       context_length=context_length, max_rows_per_forward=max_rows_per_forward)
    if model.config.num_nextn_predict_layers:
        from verispec_glm5.draft_head_glm5next import Glm5NextNextNHead

        model.draft_head = Glm5NextNextNHead(model)
    return model


def config_from_gguf(gguf: GGUFFile) -> Glm5NextConfig:
    """The config of an opened glm5-next GGUF (`Glm5NextConfig.from_gguf`)."""
    return Glm5NextConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                    source=gguf.path)
