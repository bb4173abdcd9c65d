"""Gemma 3 text trunk (math only; `loader.py` does the file I/O).

References: transformers 5.24 `models/gemma3/modeling_gemma3.py` (Gemma3TextModel,
Gemma3ForCausalLM) and llama.cpp's gemma3 graph; the forward is docs/reference/gemma4.md §3.2.

Shape legend: n rows in a forward, D hidden size, H / Hkv query / KV heads, Dh head dim,
F MLP width, V vocabulary, L layers.

Per layer (pre + post norms around both blocks):
    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
Attention: QK-norm, RoPE (local base 1e4 on sliding layers, global base + optional linear
scaling on full layers), scale query_pre_attn_scalar^-0.5, sliding window 0 <= q-k < W on
5 of every 6 layers. MLP: GeGLU (gelu-tanh). Tied embeddings scaled by sqrt(D); optional
final logit softcap. Norm weights are used as stored: gemma3 GGUFs hold 1 + w already.

Tensor parallelism (`shards`, verispec.nn.parallel), as the llama family: each rank builds the
modules with its sizes (nn.parallel.shard_config: H/W query and Hkv/W KV heads, with their
caches, sliding and full layers alike; its run of F and of V). q/k/v and gate|up are
column-parallel; o_proj and down_proj are row-parallel, their partial sums all-reduced
(nn.parallel.reduce_partial) before post_attention_layernorm / post_feedforward_layernorm, which
need the whole row. The q/k norms are per head (every rank holds the whole [Dh] weight), and so
are the attention softcap and the sliding window. The tied embedding / LM head is
vocabulary-parallel (nn.trunk_module.TrunkModule): the √D scale multiplies the all-reduced row, and the
final logit softcap runs after the vocabulary gather (one process's op on the whole [r, V] row,
not per shard: an elementwise tanh over a different width need not round the same way under
vectorisation). Such a layer runs op by op (the fused C layer has no collective).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from verispec.errors import DamagedFile, UnsupportedArchitecture
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.attention import attend_rows
from verispec.nn.layers import DecoderLayerKernel, forward_layers, fused_kernel
from verispec.nn.kv_cache import MAX_VERIFY_ROWS, PagedKVCache, RingKVCache
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.parallel import Shards, reduce_partial, shard_config
from verispec.nn.rope import RotaryEmbedding, linear_scaling
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

SLIDING, FULL = "sliding_attention", "full_attention"


@attrs.frozen
class Gemma3Config:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # Dh
    #: per layer: "sliding_attention" | "full_attention".
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    #: window W of sliding layers (positions visible, the query's own included).
    sliding_window: int = 512
    rms_norm_eps: float = 1e-6
    #: RoPE base of full layers (GGUF rope.freq_base) and of sliding layers (llama.cpp hard-codes 1e4).
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    #: linear RoPE scaling of full layers only (4B/12B/27B: 8); None = off.
    rope_scaling_factor: float | None = None
    #: attention scale = query_pre_attn_scalar^-0.5; head_dim except the 27B (D / H).
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    #: the LM head is the embedding table (every gemma3 GGUF: no output.weight).
    tie_word_embeddings: bool = True

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> Gemma3Config:
        """Read `gemma3.*` keys, with llama.cpp's gemma3 defaults for what the file omits
        (docs/reference/gemma4.md §2.1), and which tensors exist.

        tensor_shapes: GGUF tensor name -> torch-order shape (V comes from token_embd; the LM head
        is tied when there is no output.weight).
        Raises errors.UnsupportedArchitecture, gguf.errors.MissingKey, gguf.errors.MissingTensor
        (token_embd), errors.DamagedFile (a sliding-window pattern that fits no layer count)."""
        arch = metadata.get("general.architecture")
        if arch != "gemma3":
            raise UnsupportedArchitecture(source, arch, ("gemma3",))
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)

        num_layers = int(key("block_count"))
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        window = int(key("attention.sliding_window", 0) or 0)
        pattern = key("attention.sliding_window_pattern", 6)
        if not window:
            layer_types = [FULL] * num_layers  # non-SWA derivatives
        else:
            layer_types = sliding_layer_types(pattern, num_layers, source=source)
        scaling = None
        if key("rope.scaling.type", None) == "linear":
            scaling = float(key("rope.scaling.factor"))
        return cls(
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            layer_types=layer_types,
            sliding_window=window or 512,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
            rope_scaling_factor=scaling,
            # llama.cpp: the 27B (62 layers) scales by (D/H)^-0.5, every other size by Dh^-0.5
            query_pre_attn_scalar=float(hidden // heads if num_layers == 62 else head_dim),
            final_logit_softcapping=key("final_logit_softcapping", None) or None,
            attn_logit_softcapping=key("attn_logit_softcapping", None) or None,
            max_position_embeddings=int(key("context_length", 32768)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
        )


def sliding_layer_types(pattern, num_layers: int, *, source: str = "the GGUF") -> list[str]:
    """Per layer "sliding_attention" | "full_attention" from `attention.sliding_window_pattern`:
    an int N (every N-th layer full, the others sliding) or, from newer converters, a bool per
    layer (true = sliding). Raises errors.DamagedFile for N < 1 or a list not one per layer."""
    if isinstance(pattern, (int, float)):
        if int(pattern) < 1:
            raise DamagedFile(source, f"attention.sliding_window_pattern is {pattern!r}: a period of 1 or more "
                              "layers is needed")
        return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]
    flags = list(pattern)
    if len(flags) != num_layers:
        raise DamagedFile(source, f"attention.sliding_window_pattern has {len(flags)} entries for "
                          f"{num_layers} layers")
    return [SLIDING if bool(p) else FULL for p in flags]


class Gemma3Attention(nn.Module):
    """QK-normed GQA self-attention of one layer. x: fp32 [n, D] -> fp32 [n, D] (under `shards`
    the sum over ranks of the row-parallel o_proj; config is then the rank's, shard_config)."""

    def __init__(self, config: Gemma3Config, layer_idx: int, device=None, shards: Shards | None = None):
        super().__init__()
        c = config
        self.shards = shards
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.is_sliding = c.layer_types[layer_idx] == SLIDING
        self.sliding_window = c.sliding_window if self.is_sliding else None
        self.scaling = c.query_pre_attn_scalar ** -0.5
        self.softcap = c.attn_logit_softcapping
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False, device=device)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, rows: Rows, layer_idx: int, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [n, H, Dh]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, Dh]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, Dh]
        qk = rope(torch.cat([self.q_norm(q), self.k_norm(k)], dim=1), cos, sin)  # [n, H + Hkv, Dh]: one RoPE call
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = attend_rows(q, k, v, rows, layer_idx, scaling=self.scaling, sliding_window=self.sliding_window,
                          softcap=self.softcap)  # [n, H, Dh]
        return reduce_partial(self.shards, self.o_proj(out.reshape(n, self.num_heads * self.head_dim)))  # [n, D]


class Gemma3DecoderLayer(nn.Module):
    #: run the layer as one C call (nn.layers) when its linears are block-packed and the kernels
    #: are built; same bits as the op-by-op forward below (the tests switch it off to compare)
    fused = True
    #: set by `TrunkModule.to_device`: op by op with the device kernels, never the C layer
    device_kernels = False

    def __init__(self, config: Gemma3Config, layer_idx: int, device=None, shards: Shards | None = None):
        super().__init__()
        c = config
        self.shards = shards
        self.is_sliding = c.layer_types[layer_idx] == SLIDING
        self.self_attn = Gemma3Attention(c, layer_idx, device, shards)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, "gelu_tanh", kernel_activation=True, device=device)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._kernel: DecoderLayerKernel | None = None

    def _fused_kernel(self, rope: RotaryEmbedding) -> DecoderLayerKernel | None:
        """The layer's nn.layers kernel (nn.layers.fused_kernel); None when it runs op by op (also
        with an attention softcap, which the kernel does not take, under shards, and in device mode)."""
        if not self.fused or self.device_kernels or self.self_attn.softcap is not None or self.shards is not None:
            return None

        def make() -> DecoderLayerKernel:
            a, mlp = self.self_attn, self.mlp
            return DecoderLayerKernel(
                qkv=[a.q_proj, a.k_proj, a.v_proj], o=a.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
                input_norm=self.input_layernorm.weight, post_attn_norm=self.post_attention_layernorm.weight,
                pre_ff_norm=self.pre_feedforward_layernorm.weight, post_ff_norm=self.post_feedforward_layernorm.weight,
                q_norm=a.q_norm.weight, k_norm=a.k_norm.weight, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, intermediate_size=mlp.intermediate_size, rotary_dim=rope.rotary_dim,
                neox=rope.style == "neox", activation="gelu_tanh", eps=self.input_layernorm.eps, scaling=a.scaling,
                sliding_window=a.sliding_window)

        return fused_kernel(self, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_up_proj", "mlp.down_proj"), make)

    def forward(self, x, rows, layer_idx, rope, cos, sin):
        """x: fp32 [n, D] -> fp32 [n, D], op by op (the model runs the fused kernel,
        nn.layers.forward_layers, where `_fused_kernel` gives one); the post norms see the
        all-reduced block outputs."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rows, layer_idx, rope, cos, sin))
        ffn = reduce_partial(self.shards, self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(ffn)


class Gemma3TextModel(nn.Module):
    """embed_tokens (also the tied LM head), layers, final norm — HF's submodule names."""

    def __init__(self, config: Gemma3Config, device=None, shards: Shards | None = None):
        super().__init__()
        c = config
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # weight [V, D]
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, i, device, shards) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_local = RotaryEmbedding.default(c.head_dim, c.rope_local_base_freq)
        scaling = linear_scaling(c.rope_scaling_factor) if c.rope_scaling_factor else None
        self.rotary_global = RotaryEmbedding.default(c.head_dim, c.rope_theta, scaling=scaling)
        # x0 = E[ids] · sqrt(D) in fp32. HF rounds sqrt(D) to the weight dtype first
        # (Gemma3TextScaledWordEmbedding: 25.25 instead of 25.298 in bf16); we keep fp32, as llama.cpp.
        self.embed_scale = math.sqrt(c.hidden_size)


class Gemma3ForCausalLM(TrunkModule):
    """The Gemma 3 trunk: a `Trunk` (the seam is verispec.nn.trunk.SequenceTrunk).

    dtype: weight dtype ("float32" | "bfloat16" | "int8", see verispec.weights.quant).
    max_rows_per_forward: longer inputs are split into chunks this long (default: 64, or the
      dtype's batch-invariance limit, weights.quant.rows_per_forward).
    max_verify_rows: the widest verify that `keep` must be able to roll back to any row; the
      sliding-window rings hold window + max(max_rows_per_forward, max_verify_rows) - 1 slots
      (nn.state); `keep` after a wider verify raises RewindBeyondWindow.
    key_block: attention key-length granularity (nn.state).
    context_length: max positions (default: the GGUF's context_length).
    shards: this rank of a tensor-parallel group (verispec.nn.parallel; None: the whole model). The
      modules then hold the rank's slices (`shard_config`), `config` stays the whole model's, and
      every forward (and `view().embed` / `logits`) is a collective all ranks must enter together
      (verispec.tensor_parallel). Raises nn.parallel.HeadsNotDivisible.
    Built on the meta device; `load_state_dict(state, assign=True)` fills the weights.
    """

    # The K ceiling; the cost model (verispec.cost_model) picks each step's K below it from measured row costs. Measured on
    # the real 270M, int8, 2 threads, ~500 tokens of context (models/gemma4/README.md): a k-row
    # verify costs 1.12x one row at k=2, 1.37x at 4, 1.99x at 5, 2.1x at 8 and 4.4x at 16, so
    # at full acceptance 8 rows emit the most tokens per second (3.8 per plain-row time).
    spec_preferred_max_draft_tokens = 7
    #: `TrunkModule.to_device`: on CUDA the block linears run kernels.triton_qmatmul, attention
    #: kernels.triton_attend over nn.kv_pool's pools (a sliding layer's window a mask there, its
    #: blocks before the window not read), the rest the C kernels' statements
    devices = ("cpu", "cuda")

    def __init__(self, config: Gemma3Config, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 max_verify_rows: int = MAX_VERIFY_ROWS, key_block: int = 64, context_length: int | None = None,
                 device="meta", shards: Shards | None = None):
        super().__init__()
        self.shards = shards
        self.shard_config = c = config if shards is None else shard_config(config, shards)
        self._init_sizes(c, dtype, max_rows_per_forward, context_length)
        self.ring_rows = max(self.max_rows_per_forward, max_verify_rows)
        self.key_block = key_block
        self.final_logit_softcap = config.final_logit_softcapping
        self.model = Gemma3TextModel(c, device, shards)
        self._finish_linears(device)
        self.config, self.vocab_size = config, config.vocab_size  # the seam's sizes are the whole model's

    def _new_layer_states(self) -> list:
        c = self.shard_config  # a rank caches its own KV heads
        pooled = self._pooled_caches()  # on a device: every layer paged in its pool, the window a mask
        if pooled is not None:
            return pooled
        return [RingKVCache(c.num_key_value_heads, c.head_dim, window=c.sliding_window, max_rows=self.ring_rows,
                            key_block=self.key_block) if layer.is_sliding else
                PagedKVCache(c.num_key_value_heads, c.head_dim, key_block=self.key_block,
                              max_positions=self.max_context_length)
                for layer in self.model.layers]

    def _embed(self, tokens):
        return self._embed_rows(tokens) * self.model.embed_scale  # [n, D] fp32 (vocabulary-parallel under shards)

    def _forward_rows(self, rows: Rows):
        m = self.model
        x = self._embed(rows.tokens)
        cos_sin = {SLIDING: m.rotary_local.cos_sin(rows.positions), FULL: m.rotary_global.cos_sin(rows.positions)}
        layers = m.layers
        ropes = [m.rotary_local if layer.is_sliding else m.rotary_global for layer in layers]
        tables = [cos_sin[SLIDING if layer.is_sliding else FULL] for layer in layers]
        outs = forward_layers([layer._fused_kernel(rope) for layer, rope in zip(layers, ropes)], x, tables, rows,
                              lambda i, h: layers[i](h, rows, i, ropes[i], *tables[i]))
        taps = dict(enumerate([x, *outs]))  # layer index -> residual rows entering it [n, D]
        return m.norm(outs[-1]), taps  # [n, D]
