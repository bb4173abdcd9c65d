"""The assistant's math: one draft step over the trunk's K/V (docs/reference/gemma4.md §4.2).

For n rows at one query position p (a draft round keeps p: the position of the pending token),
with x = [E_trunk[t]·√D ‖ h] (the trunk's scaled embedding of the token, then a hidden row):

    z = pre_projection(x)                                        [n, 2D] -> [n, d]
    per layer (sliding or full; K/V are the trunk's, already normed and rotated):
        q = RoPE_type(q_norm(q_proj(input_layernorm(z))), p)      Q only: no K/V projections
        z = z + post_attention_layernorm(o_proj(softmax(q·Kᵀ)·V))  scale 1.0, GQA over the trunk's KV heads
        z = z + post_feedforward_layernorm(GeGLU(pre_feedforward_layernorm(z)))
        z = z · layer_scalar
    zn = norm(z);  h_next = post_projection(zn)                  [n, d] -> [n, D], the next step's row
    logits = zn @ E_assistantᵀ  (dense), or the centroid head     no softcap

Source: transformers 5.24 Gemma4AssistantForCausalLM (its Gemma4TextModel with every layer
KV-shared) and Gemma4AssistantMaskedEmbedder. Shape letters: n rows, d the assistant's width,
D the trunk's, H query heads, Hkv the trunk's KV heads, Dh head dim, T KV slots, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.rope import RotaryEmbedding
from verispec_gemma4.modeling_gemma4 import FULL, SLIDING, full_layer_inv_freq

from verispec_gemma4_assistant.config import AssistantConfig

__all__ = ["Gemma4Assistant", "attend_kv"]

#: one layer type's trunk KV: chunks (k, v fp32 [Hkv, T_c, Dh], position per slot int64 [T_c], -1 = not
#: visible), e.g. one per key block, views of the trunk's cache (trunk_view.Gemma4TrunkView.kv_window).
KV = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def attend_kv(q: torch.Tensor, kv: KV) -> torch.Tensor:
    """Attention of query rows q fp32 [n, H, Dh] over K/V chunks (all rows see the same slots:
    those with a position >= 0), scale 1.0, one softmax over every chunk's slots; query head j
    reads KV head j // (H / Hkv). Nothing is gathered: each chunk is read where it lies.
    Returns fp32 [n, H, Dh]; zeros when no slot is visible."""
    n, num_heads, head_dim = q.shape
    chunks = [(k, v, positions >= 0) for k, v, positions in kv]
    chunks = [chunk for chunk in chunks if bool(chunk[2].any())]
    if not chunks:
        return q.new_zeros(q.shape)
    num_kv = chunks[0][0].shape[0]
    groups = num_heads // num_kv
    qg = q.view(n, num_kv, groups, head_dim).permute(1, 0, 2, 3).reshape(num_kv, n * groups, head_dim)
    scores = torch.cat([torch.matmul(qg, k.transpose(1, 2)).masked_fill(~visible, float("-inf"))
                        for k, _, visible in chunks], dim=-1)  # [Hkv, n·g, T]
    weights = torch.softmax(scores, dim=-1)
    out, start = None, 0
    for _, v, visible in chunks:
        part = torch.matmul(weights[..., start:start + visible.numel()], v)  # [Hkv, n·g, Dh]
        out, start = part if out is None else out + part, start + visible.numel()
    return out.view(num_kv, n, groups, head_dim).permute(1, 0, 2, 3).reshape(n, num_heads, head_dim)


class AssistantLayer(nn.Module):
    def __init__(self, config: AssistantConfig, layer_idx: int, device=None):
        super().__init__()
        c, d = config, config.hidden_size
        self.layer_type = c.layer_types[layer_idx]
        self.num_heads, self.head_dim = c.num_attention_heads, c.layer_head_dim(layer_idx)
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False, device=device)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False, device=device)
        self.mlp = GatedMLP(d, c.intermediate_size[layer_idx], "gelu_tanh", device=device)
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, z: torch.Tensor, kv: KV, rope: RotaryEmbedding, cos, sin) -> torch.Tensor:
        n = z.shape[0]
        q = self.q_proj(self.input_layernorm(z)).view(n, self.num_heads, self.head_dim)
        q = rope(self.q_norm(q), cos, sin)
        attn = self.o_proj(attend_kv(q, kv).reshape(n, self.num_heads * self.head_dim))
        z = z + self.post_attention_layernorm(attn)
        z = z + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(z)))
        return z * self.layer_scalar


class AssistantModel(nn.Module):
    """The decoder: embed_tokens (the tied LM head only), layers, norm; HF's names."""

    def __init__(self, config: AssistantConfig, device=None):
        super().__init__()
        c = config
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # weight [V, d]
        self.layers = nn.ModuleList(AssistantLayer(c, i, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Centroids(nn.Module):
    """The ordered-embedding head's centroid table [C, d] (HF masked_embedding.centroids)."""

    def __init__(self, config: AssistantConfig, device=None):
        super().__init__()
        self.centroids = nn.Linear(config.hidden_size, config.num_centroids, bias=False, device=device)


class Gemma4Assistant(nn.Module):
    """The assistant drafter's weights and one step (module docstring). `token_ordering` (int64
    [V], set by the loader when the file has a centroid head) lists each centroid's V/C tokens."""

    def __init__(self, config: AssistantConfig, device=None):
        super().__init__()
        c = self.config = config
        self.model = AssistantModel(c, device)
        self.pre_projection = nn.Linear(2 * c.backbone_hidden_size, c.hidden_size, bias=False, device=device)
        self.post_projection = nn.Linear(c.hidden_size, c.backbone_hidden_size, bias=False, device=device)
        self.masked_embedding = Centroids(c, device) if c.num_centroids else None
        self.token_ordering: torch.Tensor | None = None
        self.rotary = {SLIDING: RotaryEmbedding.default(c.head_dim, c.rope_local_base_freq)}
        self.set_full_rope(c.full_rope_freq_factors)

    def set_full_rope(self, factors) -> None:
        """Full layers' RoPE from per-pair divisors (rope_freqs; None = every pair rotates)."""
        self.rotary[FULL] = RotaryEmbedding(full_layer_inv_freq(_RopeFields(self.config, factors)))

    def forward(self, x: torch.Tensor, kv: dict[str, KV], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [n, 2D] (scaled trunk embedding ‖ hidden row), kv: layer type -> the trunk's K/V,
        pos: the query position of every row. Returns (zn fp32 [n, d] for `logits`, h_next fp32 [n, D])."""
        positions = torch.full((x.shape[0],), pos, dtype=torch.long)
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.rotary.items()}
        z = self.pre_projection(x)
        for layer in self.model.layers:
            z = layer(z, kv[layer.layer_type], self.rotary[layer.layer_type], *cos_sin[layer.layer_type])
        zn = self.model.norm(z)
        return zn, self.post_projection(zn)

    def logits(self, zn: torch.Tensor, *, centroids: bool = False) -> torch.Tensor:
        """fp32 [n, V] over zn fp32 [n, d]: the dense tied head, or (centroids=True, the file having
        them) the centroid head: the top-k centroids' tokens scored, every other token set to
        the smallest score over the rows minus 1 (transformers' fill). Raises ValueError for
        centroids=True without a centroid table."""
        if not centroids:
            return self.model.embed_tokens(zn)
        if self.masked_embedding is None or self.token_ordering is None:
            raise ValueError("this assistant file has no centroid head (mtp_centroids, mtp_token_ordering)")
        c = self.config
        top = torch.topk(self.masked_embedding.centroids(zn), c.centroid_top_k, dim=-1).indices  # [n, k]
        ids = self.token_ordering.view(c.num_centroids, -1)[top].reshape(zn.shape[0], -1)  # [n, k·V/C]
        rows = self.model.embed_tokens.rows(ids.reshape(-1)).view(*ids.shape, -1)  # [n, k·V/C, d]
        selected = torch.matmul(rows, zn[:, :, None])[..., 0]  # [n, k·V/C]
        out = zn.new_full((zn.shape[0], c.vocab_size), selected.min().item() - 1.0)
        return out.scatter_(1, ids, selected)


class _RopeFields:
    """What full_layer_inv_freq reads, from an assistant config and divisors."""

    def __init__(self, config: AssistantConfig, factors):
        self.global_head_dim, self.rope_theta = config.global_head_dim, config.rope_theta
        self.full_rope_freq_factors = factors


