"""GGUF -> config -> module for glm-dsa files (GLM-5 / 5.1 / 5.2): I/O only.

`load(path, dtype=..., context_length=...)` is the TrunkSpec loader: `GlmDsaConfig.from_gguf`
(docs/reference/glm5-nemotron.md §5.2), then `TENSORS` through `verispec.gguf.load.load_trunk`
(values as stored: plain norm weights, k_b / v_b in llama.cpp's per-head split, §5.3). Indexer
rows are looked up only on full layers (a shared layer has no indexer module; its indexer tensors,
where a file carries them, are ignored: `shared_layer_indexers`); a file holding other tensors
the math would not use is refused (errors.UnusedTensors). The NextN block `blk.{L}` maps
onto `mtp.*` (`loader.nextn_tensors`) and becomes the trunk's `draft_head`.
"""
from __future__ import annotations

import os

from verispec.gguf.io import GGUFFile
from verispec.gguf.load import Arch, load_trunk
from verispec.gguf.table import Tensor

from verispec_glm5.loader import LAYER_TENSORS as GLM4MOE_LAYER_TENSORS, with_nextn
from verispec_glm5.modeling_glm4moe import check_file_kind
from verispec_glm5.modeling_glm_dsa import ARCHITECTURES, GlmDsaConfig, GlmDsaForCausalLM

__all__ = ["ARCHS", "DEFAULT_DTYPE", "TENSORS", "load"]

#: int8 weight-only: batch-invariant (a verify row is bitwise the one-row decode).
DEFAULT_DTYPE = "int8"

_L = "model.layers.{i}."
_A = _L + "self_attn."
#: dense SwiGLU and MoE rows as glm4moe's; the selection bias optional (llama.cpp: absent = zero)
_FFN = tuple(Tensor(t.source, t.state_name, optional=True) if "exp_probs_b" in str(t.source) else t
             for t in GLM4MOE_LAYER_TENSORS if ".mlp." in t.state_name)
#: GGUF tensor -> parameter; entries the model does not have are never looked up.
TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output.weight", "lm_head.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    Tensor("blk.{i}.attn_norm.weight", _L + "input_layernorm.weight"),
    Tensor("blk.{i}.ffn_norm.weight", _L + "post_attention_layernorm.weight"),
    Tensor("blk.{i}.attn_q_a.weight", _A + "q_a_proj.weight"),
    Tensor("blk.{i}.attn_q_a_norm.weight", _A + "q_a_layernorm.weight"),
    Tensor("blk.{i}.attn_q_b.weight", _A + "q_b_proj.weight"),
    Tensor("blk.{i}.attn_kv_a_mqa.weight", _A + "kv_a_proj_with_mqa.weight"),
    Tensor("blk.{i}.attn_kv_a_norm.weight", _A + "kv_a_layernorm.weight"),
    Tensor("blk.{i}.attn_k_b.weight", _A + "k_b"),
    Tensor("blk.{i}.attn_v_b.weight", _A + "v_b"),
    Tensor("blk.{i}.attn_output.weight", _A + "o_proj.weight"),
    Tensor("blk.{i}.indexer.attn_q_b.weight", _A + "indexer.wq_b.weight"),
    Tensor("blk.{i}.indexer.attn_k.weight", _A + "indexer.wk.weight"),
    Tensor("blk.{i}.indexer.k_norm.weight", _A + "indexer.k_norm.weight"),
    Tensor("blk.{i}.indexer.k_norm.bias", _A + "indexer.k_norm.bias"),
    Tensor("blk.{i}.indexer.proj.weight", _A + "indexer.weights_proj.weight"),
    *_FFN,
)


#: a file's table: `TENSORS`, and the NextN block's rows when the file has one
main_tensors = with_nextn(TENSORS)


def shared_layer_indexers(config: GlmDsaConfig) -> list[str]:
    """Indexer tensors of shared layers: GLM-5.2 files may carry them (unsloth's do); the layer reuses
    the previous full layer's selection, so they are never read (nor by llama.cpp)."""
    names = ("attn_q_b.weight", "attn_k.weight", "k_norm.weight", "k_norm.bias", "proj.weight")
    return [f"blk.{i}.indexer.{n}" for i, full in enumerate(config.indexer_full) if not full for n in names]


ARCHS = {name: Arch(lambda gguf: config_from_gguf(gguf), GlmDsaForCausalLM, main_tensors, layout="glm-dsa",
                    family=name, default_dtype=DEFAULT_DTYPE,
                    check_kind=lambda gguf: check_file_kind(gguf.metadata, gguf, source=gguf.path),
                    ignored=shared_layer_indexers, draft_head="mtp.")
         for name in ARCHITECTURES}


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         max_rows_per_forward: int | None = None, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None) -> GlmDsaForCausalLM:
    """Load a glm-dsa GGUF as a `GlmDsaForCausalLM` trunk (verispec.gguf.load.load_trunk).

    dtype: "int8" (default) | "bfloat16" | "float32" | "int4" | "gguf" (linears; everything else fp32).
    context_length: max positions (default: the file's context_length).
    Raises gguf.errors (MissingKey, MissingTensor, BadTensorShape, ...), errors.UnsupportedArchitecture,
    errors.DamagedFile, errors.UnusedTensors, UnsupportedGlm4MoeVariant (non-sigmoid gating, YaRN,
    several NextN blocks, an MTP-only file, indexer types that do not fit),
    weights.quant.UnknownWeightDtype. `.draft_head` is set when the file holds a NextN block.
    """
    model = load_trunk(path, ARCHS, dtype=dtype, use_cache=use_cache, tokenizer=tokenizer, progress=progress,
                       context_length=context_length, max_rows_per_forward=max_rows_per_forward)
    if model.config.num_nextn_predict_layers:
        from verispec_glm5.draft_head_glm_dsa import GlmDsaNextNHead

        model.draft_head = GlmDsaNextNHead(model)
    return model


def config_from_gguf(gguf: GGUFFile) -> GlmDsaConfig:
    """The config of an opened glm-dsa GGUF (`GlmDsaConfig.from_gguf`)."""
    return GlmDsaConfig.from_gguf(gguf.metadata, {name: gguf.tensor_info(name).shape for name in gguf},
                                  source=gguf.path)
