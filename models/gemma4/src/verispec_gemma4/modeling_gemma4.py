"""Gemma 4 text trunk (math only; `loader.py` does the file I/O).

References: transformers 5.24 `models/gemma4/modeling_gemma4.py` (Gemma4TextModel,
Gemma4TextDecoderLayer, Gemma4TextRouter/Experts) and llama.cpp's gemma4 graph; the
forward is docs/reference/gemma4.md §3.3. No real Gemma 4 weights were available offline: the
math is checked against transformers on tiny random configs only.

Shape legend: n rows in a forward, D hidden size, H / Hkv query / KV heads, Dh head dim
(per layer type: `head_dim` on sliding layers, `global_head_dim` on full ones), F MLP width
(per layer), V vocabulary, L layers, P per-layer-embedding width, E experts, k experts
used per row.

What differs from Gemma 3 (modeling_gemma3.py):
- two head sizes (and possibly two KV-head counts); full layers use "proportional" RoPE
  (only the first pairs rotate, with frequencies over the whole head dim);
- attention scale 1.0 (q_norm absorbs it); V is RMS-normed without a weight; on K=V models
  the full layers have no v_proj and V is the raw K projection;
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V and attend to the cache
  of the last non-shared layer of their own type;
- per-layer embeddings (PLE): a per-layer residual signal gated into each layer;
- optional MoE block beside the dense MLP; a per-layer output scalar; final softcap.
Norm weights are used as stored: gemma4 GGUFs hold w (no +1).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from verispec.errors import DamagedFile, UnsupportedArchitecture
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.attention import attend_rows
from verispec.nn.kv_cache import MAX_VERIFY_ROWS, PagedKVCache, RingKVCache
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.rope import RotaryEmbedding, default_inv_freq
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

SLIDING, FULL = "sliding_attention", "full_attention"

# llama.cpp writes proportional RoPE as per-pair divisors in `rope_freqs`: 1.0 for rotated
# pairs, 1e30 for the others; a divisor this large means "frequency 0" (identity), as in HF.
_UNROTATED_FACTOR = 1e20


def _per_layer(value, num_layers: int, key: str, source: str) -> tuple[int, ...]:
    """A count stored once for all layers or as one entry per layer, per layer.
    Raises errors.DamagedFile for a list that is not one per layer."""
    if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, str):
        values = tuple(int(v) for v in value)
        if len(values) != num_layers:
            raise DamagedFile(source, f"{key} has {len(values)} entries for {num_layers} layers")
        return values
    return (int(value),) * num_layers


def _layer_types(pattern, num_layers: int, source: str) -> list[str]:
    """Per layer "sliding_attention" | "full_attention" from `attention.sliding_window_pattern`:
    absent, llama.cpp's default (5 sliding then 1 full); an int N (every N-th layer full); a bool
    per layer (true = sliding). Raises errors.DamagedFile for N < 1 or a list not one per layer."""
    if pattern is None or isinstance(pattern, (int, float)):
        period = 6 if pattern is None else int(pattern)
        if period < 1:
            raise DamagedFile(source, f"attention.sliding_window_pattern is {pattern!r}: a period of 1 or more "
                              "layers is needed")
        return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    flags = list(pattern)
    if len(flags) != num_layers:
        raise DamagedFile(source, f"attention.sliding_window_pattern has {len(flags)} entries for "
                          f"{num_layers} layers")
    return [SLIDING if bool(p) else FULL for p in flags]


@attrs.frozen
class Gemma4Config:
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int  # L
    num_attention_heads: int  # H (both layer types)
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    #: Hkv and F per layer (GGUF may store either as a per-layer array).
    num_key_value_heads: tuple[int, ...] = attrs.field(converter=tuple)
    intermediate_size: tuple[int, ...] = attrs.field(converter=tuple)
    head_dim: int = 256  # sliding layers
    global_head_dim: int = 512  # full layers
    sliding_window: int = 512
    num_kv_shared_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # full layers
    rope_local_base_freq: float = 10_000.0  # sliding layers
    #: divisor per frequency pair of the full layers' RoPE (llama.cpp rope_freqs); None = all 1.
    full_rope_freq_factors: tuple[float, ...] | None = None
    #: P; 0 = no per-layer embeddings.
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    #: full layers have no v_proj: V is the raw K projection (26B, 31B).
    attention_k_eq_v: bool = False
    num_experts: int = 0  # E; 0 = dense only
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose K/V `layer_idx` attends to: itself, or for a KV-shared layer the last
        non-shared layer of the same type (E2B: sliding -> 13, full -> 14)."""
        first_shared = self.first_kv_shared_layer
        if layer_idx < first_shared:
            return layer_idx
        kind = self.layer_types[layer_idx]
        for i in range(first_shared - 1, -1, -1):
            if self.layer_types[i] == kind:
                return i
        raise ValueError(f"layer {layer_idx} shares KV but no earlier {kind} layer computes any")

    def layer_head_dim(self, layer_idx: int) -> int:
        return self.head_dim if self.layer_types[layer_idx] == SLIDING else self.global_head_dim

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> Gemma4Config:
        """Read `gemma4.*` keys (docs/reference/gemma4.md §2.3) and what only the tensor table says:
        the vocab sizes (token_embd, per_layer_token_embd rows), K=V (a full layer without
        attn_v), tying (no output.weight).

        tensor_shapes: GGUF tensor name -> torch-order shape. `full_rope_freq_factors` is data,
        not metadata: the loader fills it in from the `rope_freqs` tensor.
        Raises errors.UnsupportedArchitecture, gguf.errors.MissingKey, gguf.errors.MissingTensor
        (token_embd), errors.DamagedFile (per-layer lists that are not one per layer, KV-shared
        layers with no earlier layer of their type to read)."""
        arch = metadata.get("general.architecture")
        if arch != "gemma4":
            raise UnsupportedArchitecture(source, arch, ("gemma4",))
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)

        num_layers = int(key("block_count"))
        layer_types = _layer_types(key("attention.sliding_window_pattern", None), num_layers, source)
        num_shared = int(key("attention.shared_kv_layers", 0))
        first_shared = num_layers - num_shared
        if not 0 < first_shared <= num_layers or set(layer_types[first_shared:]) - set(layer_types[:first_shared]):
            raise DamagedFile(source, f"attention.shared_kv_layers is {num_shared} of {num_layers} layers: a shared "
                              "layer needs an earlier layer of its type that computes K/V")
        full = [i for i, t in enumerate(layer_types[:first_shared]) if t == FULL]
        global_head_dim = int(key("attention.key_length"))
        per_layer_embd = tensor_shapes.get("per_layer_token_embd.weight")
        return cls(
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=int(key("embedding_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=int(key("attention.head_count")),
            layer_types=layer_types,
            num_key_value_heads=_per_layer(key("attention.head_count_kv"), num_layers,
                                           "attention.head_count_kv", source),
            intermediate_size=_per_layer(key("feed_forward_length"), num_layers, "feed_forward_length", source),
            head_dim=int(key("attention.key_length_swa", global_head_dim)),
            global_head_dim=global_head_dim,
            sliding_window=_sliding_window(key("attention.sliding_window", 512), source),
            num_kv_shared_layers=num_shared,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
            hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0)),
            vocab_size_per_layer_input=int(per_layer_embd[0]) if per_layer_embd else 0,
            attention_k_eq_v=bool(full) and f"blk.{full[0]}.attn_v.weight" not in tensor_shapes,
            num_experts=int(key("expert_count", 0)),
            top_k_experts=int(key("expert_used_count", 0)),
            moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
            final_logit_softcapping=key("final_logit_softcapping", None) or None,
            max_position_embeddings=int(key("context_length", 131072)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
        )


def full_layer_inv_freq(config: Gemma4Config) -> torch.Tensor:
    """fp32 [global_head_dim/2]: theta^(-2i/Dh) divided by the rope_freqs factors; pairs with a
    huge factor get frequency exactly 0 (HF _compute_proportional_rope_parameters)."""
    inv_freq = default_inv_freq(config.global_head_dim, config.rope_theta)
    if config.full_rope_freq_factors is None:
        return inv_freq
    factors = torch.tensor(config.full_rope_freq_factors, dtype=torch.float32)
    return torch.where(factors >= _UNROTATED_FACTOR, torch.zeros_like(inv_freq), inv_freq / factors)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer_idx: int, device=None):
        super().__init__()
        c = config
        self.is_sliding = c.layer_types[layer_idx] == SLIDING
        self.sliding_window = c.sliding_window if self.is_sliding else None
        self.num_heads, self.head_dim = c.num_attention_heads, c.layer_head_dim(layer_idx)
        self.num_kv_heads = c.num_key_value_heads[layer_idx]
        self.is_kv_shared = layer_idx >= c.first_kv_shared_layer
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=False, device=device)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        if not self.is_kv_shared:
            self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=False, device=device)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, c.rms_norm_eps, with_weight=False)
            has_v = not (c.attention_k_eq_v and not self.is_sliding)
            self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=False,
                                    device=device) if has_v else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=False, device=device)

    def forward(self, x, rows: Rows, cache_layer: int, rope, cos, sin):
        """cache_layer: the layer whose cache this one reads (its own, or its KV source's)."""
        n = x.shape[0]
        q = rope(self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)), cos, sin)  # [n, H, Dh]
        k = v = None  # shared layers read the K/V their source layer wrote this forward
        if not self.is_kv_shared:
            k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, Dh]
            v = k if self.v_proj is None else self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            k, v = rope(self.k_norm(k), cos, sin), self.v_norm(v)
        out = attend_rows(q, k, v, rows, cache_layer, scaling=1.0, sliding_window=self.sliding_window)  # [n, H, Dh]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))  # [n, D]


class Gemma4Router(nn.Module):
    """Top-k routing: softmax over E of proj(norm(x) · scale · D^-0.5), renormalised over the
    k picks, times a per-expert scale. x: [n, D] -> (weights fp32 [n, k], experts int64 [n, k])."""

    def __init__(self, config: Gemma4Config, device=None):
        super().__init__()
        c = config
        self.top_k, self.root_size = c.top_k_experts, c.hidden_size ** -0.5
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, with_weight=False)
        self.proj = nn.Linear(c.hidden_size, c.num_experts, bias=False, device=device)
        self.scale = nn.Parameter(torch.ones(c.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(c.num_experts), requires_grad=False)

    def forward(self, x):
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root_size), dim=-1)  # [n, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Experts(nn.Module):
    """E GeGLU experts, one fused gate|up linear [2·Fe, D] and one down [D, Fe] each.

    Rows are gathered per expert, so every row meets the same kernels in the same expert
    order whatever the batch (batch-invariant with int8/bf16 linears)."""

    def __init__(self, config: Gemma4Config, device=None):
        super().__init__()
        c = config
        self.intermediate = c.moe_intermediate_size
        self.gate_up_proj = nn.ModuleList(nn.Linear(c.hidden_size, 2 * c.moe_intermediate_size, bias=False,
                                                    device=device) for _ in range(c.num_experts))
        self.down_proj = nn.ModuleList(nn.Linear(c.moe_intermediate_size, c.hidden_size, bias=False, device=device)
                                       for _ in range(c.num_experts))

    def forward(self, x, weights, experts):
        out = torch.zeros_like(x)  # [n, D]
        for e in torch.unique(experts).tolist():  # ascending expert index
            rows, slot = torch.where(experts == e)
            gate, up = self.gate_up_proj[e](x[rows]).split(self.intermediate, dim=-1)
            y = self.down_proj[e](F.gelu(gate, approximate="tanh") * up)  # [rows, D]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer_idx: int, device=None):
        super().__init__()
        c = config
        D, eps = c.hidden_size, c.rms_norm_eps
        self.is_sliding = c.layer_types[layer_idx] == SLIDING
        self.self_attn = Gemma4Attention(c, layer_idx, device)
        self.mlp = GatedMLP(D, c.intermediate_size[layer_idx], "gelu_tanh", device=device)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.has_moe = c.num_experts > 0
        if self.has_moe:
            self.router = Gemma4Router(c, device)
            self.experts = Gemma4Experts(c, device)
            self.post_feedforward_layernorm_1 = RMSNorm(D, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(D, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(D, eps)
        self.has_ple = c.hidden_size_per_layer_input > 0
        if self.has_ple:
            P = c.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(D, P, bias=False, device=device)
            self.per_layer_projection = nn.Linear(P, D, bias=False, device=device)
            self.post_per_layer_input_norm = RMSNorm(D, eps)

    def forward(self, x, per_layer_input, rows, cache_layer, rope, cos, sin):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rows, cache_layer, rope, cos, sin))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.has_moe:  # dense MLP and experts side by side, both reading the same residual x
            weights, experts = self.router(x)
            moe = self.experts(self.pre_feedforward_layernorm_2(x), weights, experts)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if self.has_ple:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input  # [n, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar  # scales the whole residual stream


class Gemma4TextModel(nn.Module):
    """embed_tokens (also the tied LM head), per-layer embeddings, layers, final norm."""

    def __init__(self, config: Gemma4Config, device=None):
        super().__init__()
        c = config
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # weight [V, D]
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_local = RotaryEmbedding.default(c.head_dim, c.rope_local_base_freq)
        self.rotary_global = RotaryEmbedding(full_layer_inv_freq(c))
        self.embed_scale = math.sqrt(c.hidden_size)  # fp32, not rounded to the weight dtype (HF does)
        self.has_ple = c.hidden_size_per_layer_input > 0
        if self.has_ple:
            L, P = c.num_hidden_layers, c.hidden_size_per_layer_input
            # a row table only (never a matmul): [V_ple, L·P], gathered per token
            self.embed_tokens_per_layer = nn.Linear(L * P, c.vocab_size_per_layer_input, bias=False, device=device)
            self.per_layer_model_projection = nn.Linear(c.hidden_size, L * P, bias=False, device=device)
            self.per_layer_projection_norm = RMSNorm(P, c.rms_norm_eps)

    def per_layer_inputs(self, tokens, x0):
        """PLE rows fp32 [n, L, P]: (norm(proj(x0) · D^-0.5) + E_ple[tokens] · sqrt(P)) · 2^-0.5."""
        n, L = tokens.numel(), len(self.layers)
        context = self.per_layer_model_projection(x0) * x0.shape[-1] ** -0.5  # [n, L·P]
        context = self.per_layer_projection_norm(context.view(n, L, -1))  # [n, L, P]
        token = self.embed_tokens_per_layer.rows(tokens).view(n, L, -1)  # [n, L, P]
        token = token * math.sqrt(token.shape[-1])
        return (context + token) * 2 ** -0.5


class Gemma4ForCausalLM(TrunkModule):
    """The Gemma 4 trunk: a `Trunk` (seam plumbing in verispec.nn.trunk.SequenceTrunk).

    Arguments as `Gemma3ForCausalLM`. KV-shared layers own no cache; they attend to their
    source layer's (`Gemma4Config.kv_source`), which is what an assistant drafter reads too.
    The hidden tap is the final-normed row, pre-softcap (what the assistant consumes).
    """

    # No real Gemma 4 was available to time; the Gemma 3 measurement (modeling_gemma3) stands in.
    spec_preferred_max_draft_tokens = 7

    def __init__(self, config: Gemma4Config, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 max_verify_rows: int = MAX_VERIFY_ROWS, key_block: int = 64, context_length: int | None = None,
                 device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        c = config
        self.ring_rows = max(self.max_rows_per_forward, max_verify_rows)
        self.key_block = key_block
        self.final_logit_softcap = c.final_logit_softcapping
        self.model = Gemma4TextModel(c, device)
        self._finish_linears(device)
        self._cache_of_layer = [c.kv_source(i) for i in range(c.num_hidden_layers)]

    def _new_layer_states(self) -> list:
        """Caches only for layers that own one; KV-shared layers read their source's."""
        return [self._make_cache(i) if source == i else None for i, source in enumerate(self._cache_of_layer)]

    def _make_cache(self, layer_idx: int):
        c = self.config
        num_kv_heads, head_dim = c.num_key_value_heads[layer_idx], c.layer_head_dim(layer_idx)
        if c.layer_types[layer_idx] == SLIDING:
            return RingKVCache(num_kv_heads, head_dim, window=c.sliding_window,
                               max_rows=self.ring_rows, key_block=self.key_block)
        return PagedKVCache(num_kv_heads, head_dim, key_block=self.key_block, max_positions=self.max_context_length)

    def view(self):
        """The read-only face a draft head binds to, with `kv_window` (trunk_view.Gemma4TrunkView)."""
        from verispec_gemma4.trunk_view import Gemma4TrunkView

        return Gemma4TrunkView(self)

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens) * self.model.embed_scale  # [n, D] fp32

    def _forward_rows(self, rows: Rows):
        m = self.model
        x = self._embed(rows.tokens)
        ple = m.per_layer_inputs(rows.tokens, x) if m.has_ple else None  # [n, L, P]
        cos_sin = {SLIDING: m.rotary_local.cos_sin(rows.positions), FULL: m.rotary_global.cos_sin(rows.positions)}
        taps = {}  # layer index -> residual rows entering it [n, D]
        for i, layer in enumerate(m.layers):
            taps[i] = x
            kind = SLIDING if layer.is_sliding else FULL
            rope = m.rotary_local if layer.is_sliding else m.rotary_global
            x = layer(x, None if ple is None else ple[:, i], rows, self._cache_of_layer[i], rope, *cos_sin[kind])
        taps[self.num_layers] = x
        return m.norm(x), taps  # [n, D]: the hidden tap (pre-softcap)


def _sliding_window(window: int, source: str) -> int:
    """The sliding layers' window: at least 1 (each of this architecture's sliding layers must see
    its own position). Raises errors.DamagedFile for 0 (check_numbers refuses negatives)."""
    if int(window) < 1:
        from verispec.errors import DamagedFile

        raise DamagedFile(source, f"attention.sliding_window is {window}: this architecture's sliding layers "
                          "need a window of at least 1")
    return int(window)
