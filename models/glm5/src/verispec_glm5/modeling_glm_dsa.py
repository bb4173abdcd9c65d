"""GLM-5 / 5.1 / 5.2 trunks (`glm-dsa`): MLA attention restricted by the DSA lightning indexer
(`mla`), dense SwiGLU leading layers, then the sigmoid-routed MoE of glm4moe (`Glm4MoeMoE`, core's
`verispec.nn.moe`).

Shape letters as `mla`; L trunk layers (a NextN block not counted), F dense FFN width.

Per layer (pre-norm residual; docs/reference/glm5-nemotron.md §5.6, transformers GlmMoeDsaDecoderLayer):
    h = h + mla(input_layernorm(h))              top-k keys from this layer's indexer ("full") or
                                                 the previous full layer's selection ("shared")
    h = h + ffn(post_attention_layernorm(h))     GGUF ffn_norm; SwiGLU (i < first_k_dense_replace) | MoE
then logits = lm_head(norm(h)).

Which layers are full (§5.2): the file's `attention.indexer.types` (bool per trunk layer, true =
full) where present; else every layer when context_length < 1048576 (GLM-5 / 5.1), else
llama.cpp's built-in GLM-5.2 schedule (layers 0, 1, 2, then every 4th from 2). Layer 0 must be full.

Batch invariance: with int8 / int4 / gguf linears, decode and verify rows (fewer than
`mla.UNABSORBED_MIN_ROWS` per sequence) run per row throughout (the absorbed MLA and the indexer
one row at a time, the router one row at a time, experts per row as in glm4moe), so a verify row
is bitwise the one-row decode. Prefill chunks of more rows run the unabsorbed form.
Sources: transformers models/glm_moe_dsa (5.24); llama.cpp src/models/glm-dsa.cpp.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

from verispec_glm5.mla import DsaIndexer, MlaAttention, MlaLayerCache, PairRope
from verispec_glm5.modeling_glm4moe import (SIGMOID_GATING, Glm4MoeMoE, UnsupportedGlm4MoeVariant,
                                            _uniform, check_file_kind)

__all__ = ["ARCHITECTURES", "GLM52_CONTEXT", "GlmDsaConfig", "GlmDsaForCausalLM", "GlmDsaNextN",
           "default_indexer_types"]

ARCHITECTURES = ("glm-dsa",)
#: context_length from which a file without `attention.indexer.types` takes the GLM-5.2 schedule.
GLM52_CONTEXT = 1048576


def default_indexer_types(num_layers: int, context_length: int) -> tuple[bool, ...]:
    """Full (True) or shared per trunk layer for a file without `attention.indexer.types`
    (llama.cpp glm-dsa.cpp: all full below GLM52_CONTEXT, else layers 0, 1 and every 4th from 2)."""
    if context_length < GLM52_CONTEXT:
        return (True,) * num_layers
    return tuple(i < 2 or (i - 2) % 4 == 0 for i in range(num_layers))


@attrs.frozen
class GlmDsaConfig:
    """The whole math of one trunk (transformers GlmMoeDsaConfig's field names); `from_gguf` reads it."""

    architecture: str  # "glm-dsa"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # r
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    index_n_heads: int  # IH
    index_head_dim: int  # ID
    index_topk: int
    indexer_full: tuple[bool, ...]  # per trunk layer: runs its own indexer
    tie_word_embeddings: bool
    num_nextn_predict_layers: int  # 1: the file holds the NextN block blk.{L}
    nextn_has_embed_tokens: bool = False  # blk.{L}.nextn.embed_tokens (else the trunk's embedding)
    nextn_has_shared_head: bool = False  # blk.{L}.nextn.shared_head_head (else the trunk's LM head)

    @property
    def num_experts(self) -> int:
        """E, the name `verispec.gguf.load` reads."""
        return self.n_routed_experts

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple], *,
                  source: str = "the GGUF") -> "GlmDsaConfig":
        """Read the config from `glm-dsa.*` keys (§5.2). tensor_shapes: GGUF name -> torch-order shape.
        Raises MissingKey, MissingTensor (token_embd), UnsupportedGlm4MoeVariant (also for an MTP-only
        file and a declared NextN block that is absent: `modeling_glm4moe.check_file_kind`)."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedGlm4MoeVariant(source, f"general.architecture is {arch!r}",
                                            f"this module loads {', '.join(ARCHITECTURES)}")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)
        gating = int(key("expert_gating_func", SIGMOID_GATING))
        if gating != SIGMOID_GATING:
            raise UnsupportedGlm4MoeVariant(source, f"glm-dsa.expert_gating_func = {gating} (not sigmoid)",
                                            "only sigmoid expert gating (2) is implemented")
        if key("rope.scaling.yarn_log_multiplier", None) is not None or key("rope.scaling.type", None):
            raise UnsupportedGlm4MoeVariant(source, "glm-dsa with RoPE scaling (YaRN)",
                                            "only unscaled RoPE is implemented (GLM-5.x files have none)")
        num_nextn = int(key("nextn_predict_layers", 0))
        if num_nextn > 1:
            raise UnsupportedGlm4MoeVariant(source, f"{num_nextn} NextN blocks",
                                            "only one NextN block is supported")
        check_file_kind(metadata, tensor_shapes, source=source)
        num_layers = int(key("block_count")) - num_nextn
        nextn = f"blk.{num_layers}.nextn."
        has_nextn = num_nextn == 1
        rope = int(key("rope.dimension_count"))
        kv_lora = int(key("attention.kv_lora_rank"))
        if int(key("attention.key_length", kv_lora + rope)) != kv_lora + rope:
            raise UnsupportedGlm4MoeVariant(source, "attention.key_length is not kv_lora_rank + rope dims",
                                            "the file's MLA sizes disagree; reconvert it")
        qk_head = int(key("attention.key_length_mla"))
        index_dim = int(key("attention.indexer.key_length"))
        if index_dim < rope:
            raise UnsupportedGlm4MoeVariant(source, f"indexer key_length {index_dim} < rope dims {rope}",
                                            "the indexer's roped part lives inside its head: reconvert it")
        context = int(key("context_length"))
        types = key("attention.indexer.types", None)
        full = (default_indexer_types(num_layers, context) if types is None
                else tuple(bool(t) for t in list(types)[:num_layers]))
        if len(full) != num_layers or not full[0]:
            raise UnsupportedGlm4MoeVariant(source, f"attention.indexer.types {list(full)}",
                                            f"give one entry per trunk layer ({num_layers}), the first full")
        n_group = int(key("expert_group_count", 1) or 1)
        uniform = functools.partial(_uniform, source=source)
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=int(key("embedding_length")),
            intermediate_size=uniform(key("feed_forward_length", 0), num_layers, "feed_forward_length"),
            num_hidden_layers=num_layers,
            num_attention_heads=int(key("attention.head_count")),
            q_lora_rank=int(key("attention.q_lora_rank")),
            kv_lora_rank=kv_lora,
            qk_nope_head_dim=qk_head - rope,
            qk_rope_head_dim=rope,
            v_head_dim=int(key("attention.value_length_mla")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=context,
            first_k_dense_replace=int(key("leading_dense_block_count", 0)),
            n_routed_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=uniform(key("expert_feed_forward_length"), num_layers,
                                          "expert_feed_forward_length"),
            n_shared_experts=int(key("expert_shared_count")),
            routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            n_group=n_group,
            topk_group=int(key("expert_group_used_count", n_group) or n_group),
            index_n_heads=int(key("attention.indexer.head_count")),
            index_head_dim=index_dim,
            index_topk=int(key("attention.indexer.top_k")),
            indexer_full=full,
            tie_word_embeddings="output.weight" not in tensor_shapes,
            num_nextn_predict_layers=int(has_nextn),
            nextn_has_embed_tokens=has_nextn and nextn + "embed_tokens.weight" in tensor_shapes,
            nextn_has_shared_head=has_nextn and nextn + "shared_head_head.weight" in tensor_shapes,
        )


class GlmDsaDecoderLayer(nn.Module):
    def __init__(self, c: GlmDsaConfig, *, is_moe: bool, full: bool, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        indexer = (DsaIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                              c.qk_rope_head_dim, c.index_topk, device=device) if full else None)
        self.self_attn = MlaAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                      q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                                      nope_dim=c.qk_nope_head_dim, rope_dim=c.qk_rope_head_dim,
                                      v_head_dim=c.v_head_dim, indexer=indexer,
                                      device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (Glm4MoeMoE(c, device=device) if is_moe
                    else GatedMLP(c.hidden_size, c.intermediate_size, "silu", device=device))
        if is_moe:  # zero unless the file has exp_probs_b (optional for glm-dsa in llama.cpp)
            self.mlp.gate.e_score_correction_bias = nn.Parameter(torch.zeros(c.n_routed_experts),
                                                                 requires_grad=False)

    def forward(self, h: torch.Tensor, cos, sin, caches, sequences, selection):
        """h fp32 [n, D] -> (fp32 [n, D], each sequence's allowed-key mask); as MlaAttention.forward."""
        attn, selection = self.self_attn(self.input_layernorm(h), cos, sin, caches, sequences, selection)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), selection


class GlmDsaNextN(nn.Module):
    """The NextN (MTP) block `blk.{L}` in transformers' MtpLayer names: enorm, hnorm, eh_proj
    ([embedding ‖ hidden] 2D -> D), mtp_block (a MoE decoder layer with its own indexer),
    post_norm (GGUF shared_head_norm); its own embed_tokens / shared_head only where the file has
    them. The math of a draft step lives in `draft_head_glm_dsa`."""

    def __init__(self, c: GlmDsaConfig, *, device=None):
        super().__init__()
        d = c.hidden_size
        self.enorm = RMSNorm(d, c.rms_norm_eps)
        self.hnorm = RMSNorm(d, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, device=device)
        self.mtp_block = GlmDsaDecoderLayer(c, is_moe=True, full=True, device=device)
        self.post_norm = RMSNorm(d, c.rms_norm_eps)
        self.embed_tokens = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                             if c.nextn_has_embed_tokens else None)  # read by rows
        self.shared_head = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                            if c.nextn_has_shared_head else None)


class GlmDsaModel(nn.Module):
    def __init__(self, c: GlmDsaConfig, *, device=None):
        super().__init__()
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # read by rows
        self.layers = nn.ModuleList(
            GlmDsaDecoderLayer(c, is_moe=i >= c.first_k_dense_replace, full=c.indexer_full[i], device=device)
            for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = PairRope(c.qk_rope_head_dim, c.rope_theta)


class GlmDsaForCausalLM(TrunkModule):
    """The glm-dsa trunk: a `Trunk` over one `mla.MlaLayerCache` per layer (latent rows, plus indexer
    keys on full layers; keep and truncate move an integer, fork shares blocks).

    dtype: weight dtype of the linears ("int8" | "bfloat16" | "float32" | "int4" | "gguf"); k_b / v_b,
    the router, norms and all state stay fp32. Built on the meta device; the loader fills it.
    `mtp` is the NextN block when the file has one (never run as a trunk layer), and
    `draft_head` its PER_TOKEN head (set by the loader).
    """

    # as glm4moe: NextN acceptance falls with depth, and a k-row verify touches up to k·top_k experts
    spec_preferred_max_draft_tokens = 4

    def __init__(self, config: GlmDsaConfig, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 context_length: int | None = None, device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        self.model = GlmDsaModel(config, device=device)
        self.mtp = GlmDsaNextN(config, device=device) if config.num_nextn_predict_layers else None
        self._finish_linears(device)
        self.draft_head = None  # set by the loader when the file has a NextN block

    def _new_layer_states(self) -> list:
        c = self.config
        return [MlaLayerCache(c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim if full else None,
                              max_positions=self.max_context_length) for full in c.indexer_full]

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens)  # [n, D] fp32

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and the residual rows entering each layer (L = after the last)."""
        m = self.model
        cos, sin = m.rotary_emb.cos_sin(rows.positions)  # [n, r/2]
        x = self._embed(rows.tokens)
        taps, selection = {}, None
        for i, layer in enumerate(m.layers):
            taps[i] = x
            caches = [s.state.layers[i] for s in rows.sequences]
            x, selection = layer(x, cos, sin, caches, rows.sequences, selection)
        taps[self.num_layers] = x
        return m.norm(x), taps
