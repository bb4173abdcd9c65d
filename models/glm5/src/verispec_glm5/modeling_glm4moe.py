"""GLM-4.5 / 4.6 / 4.7 trunks (`glm4moe`): GQA attention with partial NeoX RoPE, dense SwiGLU
leading layers, then sigmoid-routed MoE layers with a shared expert; the NextN (MTP) block the
draft head runs.

Shape letters: n rows in a forward, V vocabulary, D model width, F dense FFN width, Fe expert
width, H / Hkv query / KV heads, Dh head dim, r rotary dims (r < Dh: partial RoPE), E experts,
k experts per row, L trunk layers (the NextN block not counted).

Per layer (pre-norm residual, as transformers Glm4MoeDecoderLayer; docs/reference/glm5-nemotron.md §3.4):
    a = input_layernorm(h)
    q, k, v = qkv_proj(a) + qkv_bias              biases on q/k/v, none on o
    q, k = q_norm(q), k_norm(k)                    per-head RMSNorm over Dh (GLM-4.5/4.6/4.7 have it)
    q, k = rope(q), rope(k)                        NeoX pairs (j, j + r/2) over the first r dims only
    h = h + o_proj(attend(q, k, v))
    h = h + ffn(post_attention_layernorm(h))      ffn = SwiGLU (i < first_k_dense_replace) | MoE + shared
then logits = lm_head(norm(h)). The MoE is core's `verispec.nn.moe` (§4): sigmoid scores, experts
chosen by score + e_score_correction_bias (GGUF `exp_probs_b`) within the kept expert groups,
weighted by the unbiased scores, normalised, times routed_scaling_factor; plus the shared expert.

The GGUF holds the values the math uses: norms are plain weights (no 1 + w), q/k rows are not
permuted (NeoX RoPE, llama.cpp LLAMA_ROPE_TYPE_NEOX). The NextN block is `blk.{L}`
(block_count - nextn_predict_layers = L): it is never run as a trunk layer.

Batch invariance: with int8 / int4 linears every op is per row (router one row at a time, each
expert over the rows routed to it, rows summing their experts in ascending order, elementwise
activations over rows padded to 64), so a row is the same bits alone or inside an n-row verify.
Sources: transformers models/glm4_moe/modeling_glm4_moe.py, modeling_layers.MtpLayer (5.24);
llama.cpp src/models/glm4-moe.cpp, src/llama-graph.cpp build_moe_ffn.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from verispec.errors import UnsupportedVariant
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.attention import attend_rows
from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.mlp import GatedMLP
from verispec.nn.moe import TopkRouter, routed_experts
from verispec.nn.norm import RMSNorm
from verispec.nn.rope import RotaryEmbedding
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

__all__ = ["ARCHITECTURES", "Glm4MoeConfig", "Glm4MoeForCausalLM", "UnsupportedGlm4MoeVariant",
           "check_file_kind"]

ARCHITECTURES = ("glm4moe",)
#: llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1 is softmax, which glm4moe never uses).
SIGMOID_GATING = 2


class UnsupportedGlm4MoeVariant(UnsupportedVariant):
    """The GGUF is a glm4moe file whose layout or math this package does not implement."""


@attrs.frozen
class Glm4MoeConfig:
    """The whole math of one trunk (transformers Glm4MoeConfig's field names); `from_gguf` reads it."""

    architecture: str  # "glm4moe"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F, the dense leading layers' FFN
    num_hidden_layers: int  # L, the trunk (NextN blocks not counted)
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # Dh
    rotary_dim: int  # r: dims of each head that rotate (GLM: Dh / 2)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    first_k_dense_replace: int  # layers 0..this-1 are dense (llama.cpp leading_dense_block_count)
    n_routed_experts: int  # E
    num_experts_per_tok: int  # k
    moe_intermediate_size: int  # Fe
    n_shared_experts: int  # the shared expert is Fe · n_shared_experts wide
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False  # llama.cpp's default when expert_weights_norm is absent
    n_group: int = 1
    topk_group: int = 1
    attention_bias: bool = True  # q/k/v biases (every GLM-4.x checkpoint)
    use_qk_norm: bool = False  # per-head q/k RMSNorm (GLM-4.5/4.6/4.7; not 4.5-Air)
    tie_word_embeddings: bool = False
    #: NextN blocks in the file (0: no draft head); only 1 is supported.
    num_nextn_predict_layers: int = 0
    #: the NextN block has its own embedding / LM head (GLM-4.5/4.6 files omit both: the trunk's serve).
    nextn_has_embed_tokens: bool = False
    nextn_has_shared_head: bool = False

    @property
    def num_experts(self) -> int:
        """E, the name `verispec.gguf.load.load_trunk` reads."""
        return self.n_routed_experts

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> Glm4MoeConfig:
        """Read the `glm4moe.*` keys (docs/reference/glm5-nemotron.md §3.2) and which optional
        tensors exist (biases, q/k norms, output, the NextN block's own embedding and head).
        Defaults are llama.cpp's: rope.freq_base 1e4, rope.dimension_count = Dh, no dense layers,
        sigmoid gating, one expert group. Per-layer arrays (head_count_kv, feed_forward_length,
        expert_feed_forward_length) must hold one value over the trunk.

        tensor_shapes: GGUF tensor name -> torch-order shape (V from token_embd).
        Raises MissingKey, MissingTensor (token_embd), UnsupportedGlm4MoeVariant."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedGlm4MoeVariant(source, f"general.architecture is {arch!r}",
                                            f"this module loads {', '.join(ARCHITECTURES)}")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)
        uniform = functools.partial(_uniform, source=source)
        _refuse_variants(key, source)
        num_nextn = int(key("nextn_predict_layers", 0))
        if num_nextn > 1:
            raise UnsupportedGlm4MoeVariant(source, f"{num_nextn} NextN blocks",
                                            "only one NextN block is supported")
        check_file_kind(metadata, tensor_shapes, source=source)
        num_layers = int(key("block_count")) - num_nextn
        nextn = f"blk.{num_layers}.nextn."
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedGlm4MoeVariant(source, "attention key and value head sizes differ",
                                            "only equal K/V head sizes are supported")
        n_group = int(key("expert_group_count", 1) or 1)
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=hidden,
            intermediate_size=uniform(key("feed_forward_length", 0), num_layers, "feed_forward_length"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=uniform(key("attention.head_count_kv", heads), num_layers, "head_count_kv"),
            head_dim=head_dim,
            rotary_dim=int(key("rope.dimension_count", head_dim)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(key("context_length")),
            first_k_dense_replace=int(key("leading_dense_block_count", 0)),
            n_routed_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=uniform(key("expert_feed_forward_length"), num_layers,
                                          "expert_feed_forward_length"),
            n_shared_experts=int(key("expert_shared_count")),
            routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),  # 0 = off, as 1
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            n_group=n_group,
            topk_group=int(key("expert_group_used_count", n_group) or n_group),
            attention_bias="blk.0.attn_q.bias" in tensor_shapes or "blk.0.attn_qkv.bias" in tensor_shapes,
            use_qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
            tie_word_embeddings="output.weight" not in tensor_shapes,
            num_nextn_predict_layers=num_nextn,
            nextn_has_embed_tokens=num_nextn > 0 and nextn + "embed_tokens.weight" in tensor_shapes,
            nextn_has_shared_head=num_nextn > 0 and nextn + "shared_head_head.weight" in tensor_shapes,
        )


def check_file_kind(metadata: Mapping[str, Any], tensor_names, *, source: str = "the GGUF") -> None:
    """Refuse, by its tensor names, a glm4moe file that is no trunk this module loads: an MTP-only
    file (no blk.0.attn_norm: llama.cpp's `--mtp` conversion), a file declaring a NextN block it
    lacks (llama.cpp then loads the trunk alone; here the key must go). Runs before the core's
    block-count check, whose "damaged file" message would mislead. Raises UnsupportedGlm4MoeVariant."""
    names = set(tensor_names)
    if "blk.0.attn_norm.weight" not in names:
        raise UnsupportedGlm4MoeVariant(source, "no trunk tensors (blk.0.attn_norm.weight): an MTP-only file",
                                        "load the main GGUF; standalone NextN files are not supported yet")
    key = functools.partial(arch_value, metadata, source=source)
    num_nextn = int(key("nextn_predict_layers", 0))
    eh_proj = f"blk.{int(key('block_count')) - num_nextn}.nextn.eh_proj.weight"
    if num_nextn == 1 and eh_proj not in names:
        raise UnsupportedGlm4MoeVariant(source, f"nextn_predict_layers = 1 without {eh_proj}",
                                        "a trunk-only file must not declare a NextN block (drop the key)")


def _refuse_variants(key, source: str) -> None:
    """Variants of the architecture whose math differs: softmax gating, M-RoPE (GLM-4.xV)."""
    gating = int(key("expert_gating_func", SIGMOID_GATING))
    if gating != SIGMOID_GATING:
        raise UnsupportedGlm4MoeVariant(source, f"glm4moe.expert_gating_func = {gating} (not sigmoid)",
                                        "only sigmoid expert gating (2) is implemented")
    if key("rope.dimension_sections", None) is not None:
        raise UnsupportedGlm4MoeVariant(source,
                                        "glm4moe.rope.dimension_sections (the GLM-4.xV M-RoPE variant)",
                                        "only the text model's 1-D RoPE is implemented")
    if int(key("expert_count", 0)) < 1 or int(key("expert_used_count", 0)) < 1:
        raise UnsupportedGlm4MoeVariant(source, "glm4moe without expert_count / expert_used_count",
                                        "the file's metadata is incomplete (llama.cpp refuses it too)")


def _uniform(value, num_layers: int, name: str, *, source: str) -> int:
    """A scalar key, or a per-block array (length block_count) whose trunk entries all agree."""
    if isinstance(value, (list, tuple, np.ndarray)):
        values = {int(v) for v in list(value)[:num_layers]}
        if len(values) != 1:
            raise UnsupportedGlm4MoeVariant(source,
                                            f"glm4moe.{name} differs between layers ({sorted(values)})",
                                            "only one value over every trunk layer is supported")
        return values.pop()
    return int(value)


# -- attention -------------------------------------------------------------------------------


class Glm4MoeAttention(nn.Module):
    """GQA with q|k|v as one linear `qkv_proj` (+ `qkv_bias`), per-head q/k RMSNorm where the file
    has it, partial NeoX RoPE, no output bias. x: fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, c: Glm4MoeConfig, *, device=None):
        super().__init__()
        d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.scaling = dh ** -0.5
        self.qkv_sizes = (h * dh, hkv * dh, hkv * dh)
        self.part_rows = {"qkv_proj": self.qkv_sizes, "qkv_bias": self.qkv_sizes}
        self.qkv_proj = nn.Linear(d, sum(self.qkv_sizes), bias=False, device=device)
        self.o_proj = nn.Linear(h * dh, d, bias=False, device=device)
        # beside the linear: quant.swap_linears swaps weight-only modules
        self.qkv_bias = (nn.Parameter(torch.zeros(sum(self.qkv_sizes)), requires_grad=False)
                         if c.attention_bias else None)
        self.q_norm = RMSNorm(dh, c.rms_norm_eps) if c.use_qk_norm else None
        self.k_norm = RMSNorm(dh, c.rms_norm_eps) if c.use_qk_norm else None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                attend) -> torch.Tensor:
        """attend(q [n, H, Dh], k, v [n, Hkv, Dh]) -> [n, H, Dh]: writes k/v to the right cache first."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.view(n, -1, self.head_dim).split([self.num_heads, self.num_kv_heads, self.num_kv_heads],
                                                       dim=1)  # [n, H, Dh], [n, Hkv, Dh], [n, Hkv, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(rope(q, cos, sin), rope(k, cos, sin), v.contiguous())  # [n, H, Dh]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


# -- FFN -------------------------------------------------------------------------------------


class Glm4MoeMoE(nn.Module):
    """Sigmoid-routed SwiGLU experts (`gate`: verispec.nn.moe.TopkRouter) plus an always-on shared
    SwiGLU expert of width Fe · n_shared_experts. x: fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, c: Glm4MoeConfig, *, device=None):
        super().__init__()
        d, fe = c.hidden_size, c.moe_intermediate_size
        self.gate = TopkRouter(d, c.n_routed_experts, c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                               routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group,
                               topk_group=c.topk_group, device=device)
        self.experts = nn.ModuleList(GatedMLP(d, fe, "silu", device=device)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = GatedMLP(d, fe * c.n_shared_experts, "silu", device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [n, k], [n, k]
        return routed_experts(x, ids, weights, self.experts) + self.shared_experts(x)


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, c: Glm4MoeConfig, *, is_moe: bool, device=None):
        super().__init__()
        self.is_moe = is_moe
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Glm4MoeAttention(c, device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (Glm4MoeMoE(c, device=device) if is_moe
                    else GatedMLP(c.hidden_size, c.intermediate_size, "silu", device=device))

    def forward(self, hidden_states: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, attend) -> torch.Tensor:
        """hidden_states fp32 [n, D] -> fp32 [n, D]; attend as in Glm4MoeAttention.forward."""
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, cos, sin, attend)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Glm4MoeNextN(nn.Module):
    """The NextN (MTP) block `blk.{L}`, in transformers' MtpLayer names: enorm, hnorm, eh_proj
    ([embedding ‖ hidden] 2D -> D), mtp_block (a MoE decoder layer), post_norm (GGUF
    shared_head_norm); its own embed_tokens / shared_head (LM head) only where the file has them.
    The math of a draft step lives in `draft_head`."""

    def __init__(self, c: Glm4MoeConfig, *, device=None):
        super().__init__()
        d = c.hidden_size
        self.enorm = RMSNorm(d, c.rms_norm_eps)
        self.hnorm = RMSNorm(d, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, device=device)
        self.mtp_block = Glm4MoeDecoderLayer(c, is_moe=True, device=device)
        self.post_norm = RMSNorm(d, c.rms_norm_eps)
        self.embed_tokens = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                             if c.nextn_has_embed_tokens else None)  # read by rows
        self.shared_head = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                            if c.nextn_has_shared_head else None)


class Glm4MoeModel(nn.Module):
    def __init__(self, c: Glm4MoeConfig, *, device=None):
        super().__init__()
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # read by rows
        self.layers = nn.ModuleList(Glm4MoeDecoderLayer(c, is_moe=i >= c.first_k_dense_replace, device=device)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.default(c.rotary_dim, c.rope_theta, style="neox")


class Glm4MoeForCausalLM(TrunkModule):
    """The glm4moe trunk: a `Trunk` over one PagedKVCache per layer (pure attention: keep and
    truncate rewind an integer).

    dtype: weight dtype of the linears ("int8" | "bfloat16" | "float32" | "int4" | "gguf",
    weights.quant); the router, norms, biases and all state stay fp32.
    Built on the meta device; the loader fills it. `mtp` is the NextN block when the file has
    one (never run as a trunk layer), and `draft_head` its PER_TOKEN head (set by the loader).
    """

    # The K ceiling: NextN acceptance falls with depth (~0.9 at the first position, ~0.6-0.75 over
    # 3-5; docs/reference/glm5-nemotron.md §9.2) and a k-row verify touches up to k·top_k experts.
    spec_preferred_max_draft_tokens = 4

    def __init__(self, config: Glm4MoeConfig, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 context_length: int | None = None, device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        self.model = Glm4MoeModel(config, device=device)
        self.mtp = Glm4MoeNextN(config, device=device) if config.num_nextn_predict_layers else None
        self._finish_linears(device)
        self.draft_head = None  # set by the loader when the file has a NextN block

    def _new_layer_states(self) -> list:
        c = self.config
        return [PagedKVCache(c.num_key_value_heads, c.head_dim, max_positions=self.max_context_length)
                for _ in range(self.num_layers)]

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens)  # [n, D] fp32

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and the residual rows entering each layer (L = after the last)."""
        m = self.model
        cos, sin = m.rotary_emb.cos_sin(rows.positions)  # [n, 1, r]
        x = self._embed(rows.tokens)
        taps = {}
        for i, layer in enumerate(m.layers):
            taps[i] = x
            x = layer(x, m.rotary_emb, cos, sin, functools.partial(self._attend, layer.self_attn, rows, i))
        taps[self.num_layers] = x
        return m.norm(x), taps

    @staticmethod
    def _attend(attn: Glm4MoeAttention, rows: Rows, layer_idx: int, q, k, v):
        """Writes this chunk's K/V into each sequence's cache of layer `layer_idx`, then attends."""
        return attend_rows(q, k, v, rows, layer_idx, scaling=attn.scaling)
