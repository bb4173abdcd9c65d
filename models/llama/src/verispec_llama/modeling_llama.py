"""Llama and Qwen2 dense trunks: GQA attention, SwiGLU MLP, RMSNorm, tied or untied LM head.

Shape letters: n rows in a forward, V vocabulary, D model width, I FFN width, H / Hkv query /
KV heads, Dh head dim, L layers, F hidden-tap width.

One forward chunk, per layer (pre-norm residual, as transformers LlamaDecoderLayer):
    h = h + o_proj(attend(rope(q_proj(norm(h)) + bq), rope(k_proj(norm(h)) + bk), v_proj(...) + bv))
    h = h + down_proj(silu(gate_proj(norm(h))) * up_proj(norm(h)))
then logits = lm_head(norm(h)). The two architectures differ only in data:
- RoPE pairing follows the GGUF layout, not HF's. llama.cpp's converter permutes the rows of
  llama's attn_q/attn_k (and their biases) so that each head's rotate-half pairs (i, i + Dh/2)
  become adjacent (2i, 2i + 1), and llama.cpp then applies LLAMA_ROPE_TYPE_NORM; qwen2 is left
  unpermuted and uses LLAMA_ROPE_TYPE_NEOX (ggml-org/llama.cpp: convert_hf_to_gguf.py
  LlamaModel.permute, src/llama-model.cpp llama_model_rope_type). Attention scores are
  invariant to the same permutation of q and k, so the output equals HF's.
- Biases on q/k/v (qwen2 always; llama when converted with attention_bias) and on o (llama
  with attention_bias) exist when the file has the tensors.
- Tied embeddings: no `output.weight`, the LM head is the embedding module itself.

q|k|v run as one linear `qkv_proj` (and one bias `qkv_bias`), gate|up as one `gate_up_proj`
(nn.mlp.GatedMLP): 3 matmul calls per layer instead of 6 (SmolLM2: 90 fewer per token),
holding the separate linears' values (every dtype quantises per output row); with the int8 /
int4 / gguf kernels each output is bitwise theirs (core/tests/test_nn.py, test_gguf_weights.py).

All activations are fp32; only the linears see the weight dtype (`verispec.weights.quant`). With
int8 or bf16 weights every op is per row, so a row inside an n-row verify is bitwise the row
computed alone (`spec_batch_invariant`, declared by `TrunkModule` from the linears).

Tensor parallelism (`shards`, verispec.nn.parallel): the same modules built with one rank's
sizes (nn.parallel.shard_config: H/W and Hkv/W heads, its run of I and of V) and an all-reduce after the
two row-parallel linears, o_proj and down_proj (the o bias after it); the embedding and LM head
are vocabulary-parallel (nn.trunk_module.TrunkModule). Such a layer runs op by op (the fused C layer has no collective).
Sources: transformers models/llama/modeling_llama.py, models/qwen2/modeling_qwen2.py (5.24);
llama.cpp src/models/llama.cpp, src/models/qwen2.cpp.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
import torch
from torch import nn
from verispec.errors import UnsupportedVariant
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.layers import DecoderLayerKernel, forward_layers, fused_kernel
from verispec.nn.attention import attend_rows
from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.parallel import Shards, reduce_partial, shard_config
from verispec.nn.rope import RotaryEmbedding, default_inv_freq, freq_factors, linear_scaling
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

__all__ = [
    "ROPE_STYLES",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "UnsupportedLlamaVariant",
]

#: GGUF general.architecture -> RoPE pairing of its q/k rows (see the module docstring).
ROPE_STYLES = {"llama": "normal", "qwen2": "neox"}


class UnsupportedLlamaVariant(UnsupportedVariant):
    """The GGUF is a llama/qwen2 file whose math this package does not implement."""


@attrs.frozen
class LlamaConfig:
    """The whole math of one trunk; sizes read from GGUF metadata and its tensor table."""

    #: "llama" | "qwen2" (picks the RoPE pairing, ROPE_STYLES).
    architecture: str
    vocab_size: int  # V: rows of token_embd (can exceed the tokenizer's list)
    hidden_size: int  # D
    intermediate_size: int  # I
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # Dh
    rms_norm_eps: float
    rope_theta: float
    #: rotary dims per head (llama.cpp n_rot); == head_dim for every known file.
    rotary_dim: int
    #: the context length the model was trained for (the default max_context_length).
    max_position_embeddings: int
    #: q/k/v carry biases (qwen2; llama converted with attention_bias).
    attention_bias: bool = False
    #: o_proj carries a bias (llama converted with attention_bias).
    attention_out_bias: bool = False
    tie_word_embeddings: bool = True
    #: position interpolation ("linear" rope scaling): positions divided by this.
    rope_linear_factor: float = 1.0
    #: llama.cpp `rope_freqs` (llama3-style scaling baked in by the converter): each
    #: frequency divided by its factor. None when the file has no such tensor.
    rope_freq_factors: tuple[float, ...] | None = None

    @property
    def rope_style(self) -> str:
        return ROPE_STYLES[self.architecture]

    @classmethod
    def from_gguf(cls, metadata: Mapping, tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> LlamaConfig:
        """Read `{arch}.*` keys (block_count, embedding_length, feed_forward_length,
        attention.head_count[_kv], attention.layer_norm_rms_epsilon, rope.freq_base,
        context_length, rope scaling) and which optional tensors exist (biases, output).

        tensor_shapes: GGUF tensor name -> torch-order shape (V comes from token_embd).
        Raises MissingKey, UnsupportedLlamaVariant. `rope_freq_factors` is data, not metadata:
        the loader fills it in from the `rope_freqs` tensor.
        """
        arch = metadata.get("general.architecture")
        if arch not in ROPE_STYLES:
            raise UnsupportedLlamaVariant(source, f"general.architecture is {arch!r}",
                                          f"this package loads {', '.join(ROPE_STYLES)}")

        key = functools.partial(arch_value, metadata, source=source)

        if key("expert_count", 0):
            raise UnsupportedLlamaVariant(source, f"{arch}.expert_count={key('expert_count')} (a mixture of experts)",
                                          "only dense llama/qwen2 files are supported")
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedLlamaVariant(source, "attention key and value head sizes differ",
                                          "only equal K/V head sizes are supported")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),  # llama.cpp's default when absent
            rotary_dim=int(key("rope.dimension_count", head_dim)),
            max_position_embeddings=int(key("context_length")),
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            attention_out_bias="blk.0.attn_output.bias" in tensor_shapes,
            tie_word_embeddings="output.weight" not in tensor_shapes,
            rope_linear_factor=_rope_linear_factor(key, source),
        )


def _rope_linear_factor(key, source: str) -> float:
    """Linear position interpolation from `rope.scaling.type/factor` (or the older
    `rope.scale_linear`); other scalings change more than the frequencies and are refused."""
    kind = key("rope.scaling.type", "none")
    if kind in ("none", ""):
        return float(key("rope.scale_linear", 1.0))
    if kind == "linear":
        return float(key("rope.scaling.factor", 1.0))
    raise UnsupportedLlamaVariant(source, f"rope scaling type {kind!r}",
                                  "supported: none, linear, and llama3-style rope_freqs factors")


class LlamaAttention(nn.Module):
    """GQA self-attention over each sequence's `PagedKVCache` of this layer. x: fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, config: LlamaConfig, *, device=None, shards: Shards | None = None):
        super().__init__()
        self.shards = shards  # None: one process; else config is the rank's (shard_config)
        d, h, hkv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.scaling = dh ** -0.5
        # q|k|v as one linear (one matmul call per layer, not three): the tensor table stacks
        # attn_q, attn_k, attn_v (and their biases) with these rows.
        self.qkv_sizes = (h * dh, hkv * dh, hkv * dh)
        self.part_rows = {"qkv_proj": self.qkv_sizes, "qkv_bias": self.qkv_sizes}
        self.qkv_proj = nn.Linear(d, sum(self.qkv_sizes), bias=False, device=device)
        self.o_proj = nn.Linear(h * dh, d, bias=False, device=device)
        # Biases sit beside the linears: `quant.swap_linears` swaps weight-only modules.
        self.qkv_bias = _bias(sum(self.qkv_sizes), config.attention_bias)
        self.o_bias = _bias(d, config.attention_out_bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                rows: Rows, layer_idx: int) -> torch.Tensor:
        n = x.shape[0]
        qkv = _add(self.qkv_proj(x), self.qkv_bias).view(n, -1, self.head_dim)  # [n, H + 2·Hkv, Dh]
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)  # v: [n, Hkv, Dh]
        qk = rope(qk, cos, sin)  # [n, H + Hkv, Dh]: one RoPE call
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = attend_rows(q, k, v, rows, layer_idx, scaling=self.scaling)  # [n, H, Dh]
        return _add(reduce_partial(self.shards, self.o_proj(out.reshape(n, self.num_heads * self.head_dim))),
                    self.o_bias)  # [n, D]


def _bias(size: int, present: bool) -> nn.Parameter | None:
    return nn.Parameter(torch.zeros(size), requires_grad=False) if present else None


def _add(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class LlamaDecoderLayer(nn.Module):
    #: run the layer as one C call (nn.layers) when its linears are block-packed and the kernels
    #: are built; same bits as the op-by-op forward below (the tests switch it off to compare)
    fused = True
    #: set by `TrunkModule.to_device`: op by op with the device kernels, never the C layer
    device_kernels = False

    def __init__(self, config: LlamaConfig, *, device=None, shards: Shards | None = None):
        super().__init__()
        self.shards = shards
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, device=device, shards=shards)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu", kernel_activation=True,
                            device=device)
        self._kernel: DecoderLayerKernel | None = None

    def _fused_kernel(self, rope: RotaryEmbedding) -> DecoderLayerKernel | None:
        """The layer's nn.layers kernel (nn.layers.fused_kernel); None when it runs op by op (also in
        device mode: `TrunkModule.to_device` sets device_kernels, and no C kernel runs)."""
        if not self.fused or self.device_kernels or self.shards is not None:
            return None

        def make() -> DecoderLayerKernel:
            a, mlp = self.self_attn, self.mlp
            return DecoderLayerKernel(
                qkv=[a.qkv_proj], o=a.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
                input_norm=self.input_layernorm.weight, pre_ff_norm=self.post_attention_layernorm.weight,
                qkv_bias=a.qkv_bias, o_bias=a.o_bias, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, intermediate_size=mlp.intermediate_size, rotary_dim=rope.rotary_dim,
                neox=rope.style == "neox", activation="silu", eps=self.input_layernorm.eps, scaling=a.scaling)

        return fused_kernel(self, ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
                            make)

    def forward(self, hidden_states: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                rows: Rows, layer_idx: int) -> torch.Tensor:
        """hidden_states: fp32 [n, D] -> fp32 [n, D], op by op (the model runs the fused kernel,
        nn.layers.forward_layers, where `_fused_kernel` gives one)."""
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, cos, sin, rows, layer_idx)
        hidden_states = hidden_states + attn
        return hidden_states + reduce_partial(self.shards, self.mlp(self.post_attention_layernorm(hidden_states)))


class LlamaModel(nn.Module):
    """embed_tokens (also the tied LM head), layers, final norm, RoPE: HF's submodule names."""

    def __init__(self, config: LlamaConfig, *, device=None, shards: Shards | None = None):
        super().__init__()
        c = config
        # The embedding table is a linear [V, D] read by rows, so a tied LM head is this same
        # module (one copy in any weight dtype).
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, device=device, shards=shards)
                                    for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(default_inv_freq(c.rotary_dim, c.rope_theta), style=c.rope_style,
                                          scaling=_rope_scaling(c))


class LlamaForCausalLM(TrunkModule):
    """The llama/qwen2 trunk: a `Trunk` (the seam is verispec.nn.trunk.SequenceTrunk).

    dtype: weight dtype ("int8" | "bfloat16" | "float32", see verispec.weights.quant).
    max_rows_per_forward: longer inputs run in chunks this long (exact for batch-invariant
      dtypes); default weights.quant.rows_per_forward(dtype): 64, 32 for bf16 (measured here too:
      bf16 F.linear changes its bits from 33 rows on this AVX2 machine, int8pack_mm never).
    context_length: max positions (default: the GGUF's context_length).
    shards: this rank of a tensor-parallel group (verispec.nn.parallel; None: the whole model). The
      modules then hold the rank's slices (`shard_config`), `config` stays the whole model's, and
      every forward (and `view().embed` / `logits`) is a collective all ranks must enter together
      (verispec.tensor_parallel). Raises nn.parallel.HeadsNotDivisible.
    Built on the meta device; `load_state_dict(state, assign=True)` fills the weights. Module
    names are transformers' where not fused (model.embed_tokens, model.layers.{i}.self_attn.o_proj,
    ..., lm_head; self_attn.qkv_proj holds q|k|v rows, mlp.gate_up_proj gate|up rows); lm_head is
    None when tied; biases are model.layers.{i}.self_attn.{qkv,o}_bias.
    """

    # The K ceiling; the cost model (verispec.cost_model) picks each step's K below it from measured row costs. A
    # (K+1)-row verify relative to one row (README.md "Verify cost", SmolLM2 / Qwen2.5-Coder):
    # int8 5 rows 1.36x / 1.39x, 9 rows 1.84x / 2.64x; bf16 <= 1.1x up to 9 rows; fp32 1.9x /
    # 2.6x at 9. At full acceptance 9 rows emit the most tokens per row-time in every dtype.
    spec_preferred_max_draft_tokens = 8
    #: `TrunkModule.to_device`: on CUDA the block linears run kernels.triton_qmatmul, attention
    #: kernels.triton_attend over nn.kv_pool's pools, the rest PyTorch statements of the C kernels
    devices = ("cpu", "cuda")

    def __init__(self, config: LlamaConfig, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 context_length: int | None = None, device="meta", shards: Shards | None = None):
        super().__init__()
        self.shards = shards
        self.shard_config = c = config if shards is None else shard_config(config, shards)
        self._init_sizes(c, dtype, max_rows_per_forward, context_length)
        self.model = LlamaModel(c, device=device, shards=shards)
        self._finish_linears(device)
        self.config, self.vocab_size = config, config.vocab_size  # the seam's sizes are the whole model's

    def _new_layer_states(self) -> list:
        c = self.shard_config  # a rank caches its own KV heads
        return self._pooled_caches() or [PagedKVCache(c.num_key_value_heads, c.head_dim,
                                                      max_positions=self.max_context_length)
                                         for _ in range(self.num_layers)]

    def _embed(self, tokens):
        return self._embed_rows(tokens)  # [n, D] fp32 (vocabulary-parallel under shards)

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and the residual rows entering each layer (index L = after the last)."""
        m = self.model
        cos, sin = m.rotary_emb.cos_sin(rows.positions)  # [n, 1, r]
        x = self._embed(rows.tokens)
        layers = m.layers
        outs = forward_layers([layer._fused_kernel(m.rotary_emb) for layer in layers], x,
                              [(cos, sin)] * len(layers), rows,
                              lambda i, h: layers[i](h, m.rotary_emb, cos, sin, rows, i))
        taps = dict(enumerate([x, *outs]))  # layer index -> residual rows entering it [n, D]
        return m.norm(outs[-1]), taps


def _rope_scaling(config: LlamaConfig):
    scalings = []
    if config.rope_linear_factor != 1.0:
        scalings.append(linear_scaling(config.rope_linear_factor))
    if config.rope_freq_factors is not None:
        scalings.append(freq_factors(config.rope_freq_factors))
    if not scalings:
        return None
    return lambda inv_freq: _chain(scalings, inv_freq)


def _chain(scalings, inv_freq: torch.Tensor) -> torch.Tensor:
    for scale in scalings:
        inv_freq = scale(inv_freq)
    return inv_freq
