"""The EAGLE-3 head's math over m rows (llama.cpp src/models/eagle3.cpp, its two graphs; revisions read: README).

Shape letters: m rows, D the head's width, Dt a trunk row's width, H / Hkv query / KV heads, Dh
head dim, I FFN width, S KV slots, Vd draft vocabulary, V the trunk's vocabulary.

Encoder (`fuse`), once per committed trunk row r (llama.cpp's encoder graph):
    x_r = taps_r                                    [3·Dt]: the residuals entering target_layers[0..2]
    x_r = rms_norm(x_r) · w_fc_norm                 only with norm_before_fc (`enc.output_norm`)
    g_r = fc · x_r                                  [D]
Decoder (`Eagle3Layer.forward`), a row = (token t, g) at position p (llama.cpp's decoder graph):
    e   = rms_norm(E[t]) · w_attn_norm               E: the head's token_embd, else the trunk's (raw rows)
    gn  = rms_norm(g) · w_attn_norm_2                the hidden norm
    x   = [e ‖ gn]                                   [2D], embedding first
    a   = o · softmax(q kᵀ / √Dh) v                  q, k, v = W x; RoPE (NORM pairing, llama.cpp's
                                                     LLAMA_ROPE_TYPE_NORM for eagle3: the converter
                                                     permutes q/k rows as for llama), causal, GQA
    r   = a + (gn if norm_before_residual else g)    the residual: the RAW g by default
    out = r + down(silu(gate(rms_norm(r)·w_ffn)) · up(rms_norm(r)·w_ffn))
    logits_d = output · (rms_norm(out) · w_output_norm)        [Vd]
    logits   = -inf everywhere, logits[d2t[i]] = logits_d[i]    [V] (llama.cpp's ggml_set_rows)
`out` (pre-norm) is the next draft step's g: the test-time recurrence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from verispec.nn.rope import RotaryEmbedding, default_inv_freq, freq_factors, linear_scaling
from verispec.weights.quant import Float32Linear, swap_linears

from verispec_eagle3.config import Eagle3Config

__all__ = ["Eagle3Layer", "HeadKV", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x fp32 [..., n] / sqrt(mean(x²) + eps) · weight (llama.cpp build_norm LLM_NORM_RMS)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


class HeadKV:
    """The head's KV of one sequence: slot = position, fp32 [Hkv, S, Dh] and the position each slot
    holds (-1 = empty: a position without a row, or a dropped provisional row). Grows on demand."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.k = torch.zeros(num_kv_heads, 0, head_dim)
        self.v = torch.zeros(num_kv_heads, 0, head_dim)
        self.positions = torch.full((0,), -1, dtype=torch.long)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v fp32 [m, Hkv, Dh] at int64 positions [m] (any, >= 0)."""
        end = int(positions.max()) + 1
        if end > self.positions.numel():
            grow = max(end, 2 * self.positions.numel(), 64) - self.positions.numel()
            self.k = torch.cat([self.k, self.k.new_zeros(self.k.shape[0], grow, self.k.shape[2])], dim=1)
            self.v = torch.cat([self.v, self.v.new_zeros(self.v.shape[0], grow, self.v.shape[2])], dim=1)
            self.positions = torch.cat([self.positions, self.positions.new_full((grow,), -1)])
        self.k[:, positions], self.v[:, positions] = k.transpose(0, 1), v.transpose(0, 1)
        self.positions[positions] = positions

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v fp32 [Hkv, S, Dh], positions int64 [S]) up to the last slot holding a row."""
        held = (self.positions >= 0).nonzero()
        end = int(held[-1]) + 1 if held.numel() else 0
        return self.k[:, :end], self.v[:, :end], self.positions[:end]

    def drop_from(self, position: int) -> None:
        """Forget every row at a position >= `position`."""
        self.positions[max(position, 0):] = -1

    def held(self) -> list[int]:
        """The positions holding a row, ascending."""
        return (self.positions >= 0).nonzero().reshape(-1).tolist()


#: GGUF name -> the layer's linear module (HF-style names; `quant.swap_linears` swaps them by dtype).
LINEARS = {"fc.weight": "fc", "blk.0.attn_q.weight": "q_proj", "blk.0.attn_k.weight": "k_proj",
           "blk.0.attn_v.weight": "v_proj", "blk.0.attn_output.weight": "o_proj", "blk.0.ffn_gate.weight": "gate_proj",
           "blk.0.ffn_up.weight": "up_proj", "blk.0.ffn_down.weight": "down_proj", "output.weight": "lm_head"}
#: GGUF name -> the layer's norm weight attribute.
NORMS = {"enc.output_norm.weight": "fc_norm", "blk.0.attn_norm.weight": "input_layernorm",
         "blk.0.attn_norm_2.weight": "hidden_norm", "blk.0.ffn_norm.weight": "post_attention_layernorm",
         "output_norm.weight": "norm"}


class Eagle3Layer(nn.Module):
    """The head's weights and math. w: GGUF name -> fp32 tensor (torch order), the file's tensors the
    math reads; the linears become `dtype`'s modules (`verispec.weights.quant`: float32 / bfloat16 /
    int8; the `gguf` mode's float-built linears are int8), the norms stay fp32. `lm_head` is None
    when the head borrows the trunk's. rope_factors: the file's rope_freqs divisors, or None."""

    def __init__(self, config: Eagle3Config, w: dict[str, torch.Tensor], rope_factors=None, *,
                 dtype: str = "float32"):
        super().__init__()
        c = self.config = config
        self.lm_head = None
        for name, attr in LINEARS.items():
            if name in w:
                setattr(self, attr, Float32Linear.from_float(w[name]))
        for name, attr in NORMS.items():
            setattr(self, attr, w[name].float() if name in w else None)
        swap_linears(self, dtype)
        scalings = []
        if c.rope_linear_factor != 1.0:
            scalings.append(linear_scaling(c.rope_linear_factor))
        if rope_factors is not None:
            scalings.append(freq_factors(rope_factors))
        scaling = None
        if scalings:
            def scaling(inv_freq):
                for scale in scalings:
                    inv_freq = scale(inv_freq)
                return inv_freq
        self.rope = RotaryEmbedding(default_inv_freq(c.head_dim, c.rope_theta), style="normal", scaling=scaling)
        self.scaling = c.head_dim ** -0.5

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps fp32 [m, 3·Dt] -> g fp32 [m, D] (the encoder)."""
        x = taps.float()
        if self.config.norm_before_fc:
            x = rms_norm(x, self.fc_norm, self.config.rms_eps)
        return self.fc(x)

    def forward(self, embeddings: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, kv: "HeadKV") -> torch.Tensor:
        """One decoder pass over m rows: embeddings fp32 [m, D] (the rows' token embeddings), g
        fp32 [m, D], positions int64 [m]. Writes the rows' K/V into `kv` at their positions, then
        row i attends every slot of `kv` holding a position <= positions[i].
        Returns out fp32 [m, D] (pre-norm: the next step's g, and what `normed` reads)."""
        c = self.config
        m = g.shape[0]
        gn = rms_norm(g, self.hidden_norm, c.rms_eps)
        x = torch.cat([rms_norm(embeddings, self.input_layernorm, c.rms_eps), gn], dim=-1)  # [m, 2D]
        cos, sin = self.rope.cos_sin(positions)
        q = self.rope(self.q_proj(x).view(m, c.num_heads, c.head_dim), cos, sin)
        k = self.rope(self.k_proj(x).view(m, c.num_kv_heads, c.head_dim), cos, sin)
        kv.write(positions, k, self.v_proj(x).view(m, c.num_kv_heads, c.head_dim))
        keys, values, key_positions = kv.read()  # [Hkv, S, Dh] x2, [S]
        visible = (key_positions[None, :] >= 0) & (key_positions[None, :] <= positions[:, None])  # [m, S]
        group = c.num_heads // c.num_kv_heads  # query head j reads KV head j // group
        qg = q.view(m, c.num_kv_heads, group, c.head_dim).permute(1, 2, 0, 3)  # [Hkv, g, m, Dh]
        scores = torch.matmul(qg, keys[:, None].transpose(-1, -2)) * self.scaling  # [Hkv, g, m, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1), values[:, None])  # [Hkv, g, m, Dh]
        attn = attn.permute(2, 0, 1, 3).reshape(m, c.num_heads * c.head_dim)  # [m, H·Dh]
        r = self.o_proj(attn) + (gn if c.norm_before_residual else g)
        h = rms_norm(r, self.post_attention_layernorm, c.rms_eps)
        ffn = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return r + ffn

    def normed(self, out: torch.Tensor) -> torch.Tensor:
        """rms_norm(out) · w_output_norm fp32 [m, D]: what the LM head reads."""
        return rms_norm(out, self.norm, self.config.rms_eps)
