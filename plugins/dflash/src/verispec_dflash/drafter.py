"""The DFlash/DFlash2 drafter's math, fp32: Pass A + B into the rings, Pass C over one block (reference note §7).

Notation: T taps, H hidden (= the target's), n_h/n_kv heads of dim d, n block rows, s the anchor's
position. Primitives: rms(x; w) = w ⊙ x / sqrt(mean(x²) + ε); headnorm = rms per head with w [d];
rope = NEOX (rotate-half) RoPE at absolute positions, θ = rope_theta, all d dims.

Pass A (per committed position p, feat_p = concat of the T tapped target rows [T·H]):
    g_p = rms(W_fc · feat_p; w_enc)
Pass B (per layer l): K_l(p) = rope(headnorm(W_k^l g_p; w_knorm^l), p), V_l(p) = W_v^l g_p -> ring l.
Pass C (ids = [anchor, mask × (n-1)] at positions s..s+n-1; h = embedding_scale · E_tgt[ids]),
per layer: x = rms(h; w_attn_norm) [-> conv side 0]; attention of Q over the visible ring rows
(position < s, and within the window for a sliding layer) and the block's own K/V (all rows, or
rows <= i when causal; within the window for a sliding layer); o = W_o · heads [-> conv side 1];
h += o; the same around the SwiGLU FFN; finally z = rms(h; w_output_norm). Nothing of Pass C is
written to the rings. Source of the math: `dflash==0.1.0` `dflash/model.py`; the exactness tests
compare against it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from verispec.nn.rope import RotaryEmbedding

from verispec_dflash.config import DFlashConfig
from verispec_dflash.conv import dynamic_kernels, grouped_conv
from verispec_dflash.ring import ContextRing


class DFlashDrafter:
    """One drafter's weights (fp32 tensors by GGUF name) and its math, shared by every sequence.

    linears: GGUF name -> module computing x fp32 [n, in] -> [n, out] for some of the 2-D weights
    (the loader's `verispec.weights.block_linear.BlockLinear` over a quantised file's own blocks:
    a quarter of the fp32 bytes a block reads, activations rounded to int8 per 32 columns as
    llama.cpp's CPU path does); the others multiply by the fp32 tensor.
    use_conv / use_selector: attribution switches for DFlash2 files (False skips the conv or the
    selector walk); they change drafts, never outputs, and are not a way to run a model.
    """

    def __init__(self, config: DFlashConfig, tensors: Mapping[str, torch.Tensor], *,
                 linears: Mapping[str, torch.nn.Module] | None = None,
                 use_conv: bool = True, use_selector: bool = True):
        self.config = config
        self.w = {name: t.float().contiguous() for name, t in tensors.items()}
        self.linears = dict(linears or {})
        self.use_conv = use_conv and config.generation == 2
        self.use_selector = use_selector and config.generation == 2
        self.rope = RotaryEmbedding.default(config.head_dim, config.rope_theta, style="neox")

    # -- rings --------------------------------------------------------------------------------

    def new_rings(self, max_context: int) -> list[ContextRing]:
        """One ContextRing per layer: W + B rows for a sliding-window layer, `max_context` (grown on demand) else."""
        c = self.config
        return [ContextRing(c.sliding_window + c.block_size if sliding else max_context, c.num_kv_heads, c.head_dim,
                            c.sliding_window if sliding else None)
                for sliding in c.sliding_layers]

    # -- Pass A + B ---------------------------------------------------------------------------

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Pass A: g fp32 [n, H] of tapped target rows fp32 [n, T·H] (concatenated in target_layers order)."""
        return self._rms(self._linear(features.float(), "fc.weight"), self.w["enc.output_norm.weight"])

    def context_kv(self, layer: int, g: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass B for one layer: K, V fp32 [n, n_kv, d] of fused rows g fp32 [n, H] at positions int64 [n]."""
        b, c = f"blk.{layer}.", self.config
        k = self._linear(g, b + "attn_k.weight").reshape(-1, c.num_kv_heads, c.head_dim)
        k = self.rope(self._rms(k, self.w[b + "attn_k_norm.weight"]), *self.rope.cos_sin(positions))
        v = self._linear(g, b + "attn_v.weight").reshape(-1, c.num_kv_heads, c.head_dim)
        return k, v

    def inject(self, rings: list[ContextRing], features: torch.Tensor, start_pos: int) -> None:
        """Pass A + B for committed rows at positions start_pos.. (features fp32 [n, T·H]) into `rings`."""
        positions = torch.arange(start_pos, start_pos + features.shape[0])
        g = self.encode(features)
        for layer, ring in enumerate(rings):
            ring.write(positions, *self.context_kv(layer, g, positions))

    # -- Pass C -------------------------------------------------------------------------------

    def block_hidden(self, rings: list[ContextRing], embeddings: torch.Tensor, anchor: int) -> torch.Tensor:
        """Pass C: post-norm block rows z fp32 [n, H] of the block's input rows fp32 [n, H]
        (already embedding-scaled) at positions anchor..anchor+n-1, over the rings' visible rows."""
        n = embeddings.shape[0]
        positions = torch.arange(anchor, anchor + n)
        cos, sin = self.rope.cos_sin(positions)
        h = embeddings.float()
        for layer, ring in enumerate(rings):
            h = self._layer(layer, ring, h, anchor, cos, sin)
        return self._rms(h, self.w["output_norm.weight"])

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logit transform: c·tanh(s·ℓ/c) with a softcap c, else s·ℓ (note §7)."""
        c = self.config
        logits = logits * c.logit_scale if c.logit_scale != 1.0 else logits
        return c.softcap * torch.tanh(logits / c.softcap) if c.softcap else logits

    def _layer(self, layer, ring, h, anchor, cos, sin):
        b, c = f"blk.{layer}.", self.config
        x = self._rms(h, self.w[b + "attn_norm.weight"])
        delta = None
        if self.use_conv:
            delta = dynamic_kernels(x, self.w[b + "attn_conv_proj.weight"], c.conv_kernel_size)
            x = grouped_conv(x, delta[:, 0], self.w[b + "attn_conv_base"][0], c.conv_group_size)
        o = self._attention(layer, ring, x, anchor, cos, sin)
        if delta is not None:
            o = grouped_conv(o, delta[:, 1], self.w[b + "attn_conv_base"][1], c.conv_group_size)
        h = h + o
        y = self._rms(h, self.w[b + "ffn_norm.weight"])
        if self.use_conv:
            delta = dynamic_kernels(y, self.w[b + "ffn_conv_proj.weight"], c.conv_kernel_size)
            y = grouped_conv(y, delta[:, 0], self.w[b + "ffn_conv_base"][0], c.conv_group_size)
        f = self._linear(F.silu(self._linear(y, b + "ffn_gate.weight")) * self._linear(y, b + "ffn_up.weight"),
                         b + "ffn_down.weight")
        if self.use_conv:
            f = grouped_conv(f, delta[:, 1], self.w[b + "ffn_conv_base"][1], c.conv_group_size)
        return h + f

    def _attention(self, layer, ring, x, anchor, cos, sin):
        b, c = f"blk.{layer}.", self.config
        n, d = x.shape[0], c.head_dim
        q = self.rope(self._rms(self._linear(x, b + "attn_q.weight").reshape(n, c.num_heads, d),
                                self.w[b + "attn_q_norm.weight"]), cos, sin)
        kb = self.rope(self._rms(self._linear(x, b + "attn_k.weight").reshape(n, c.num_kv_heads, d),
                                 self.w[b + "attn_k_norm.weight"]), cos, sin)
        vb = self._linear(x, b + "attn_v.weight").reshape(n, c.num_kv_heads, d)
        k_ctx, v_ctx, ctx_mask = ring.visible(anchor, n)
        k = torch.cat([k_ctx, kb])  # [m + n, n_kv, d]
        v = torch.cat([v_ctx, vb])
        mask = torch.cat([ctx_mask, self._block_mask(n, ring.window)], dim=1)  # [n, m + n]
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [m + n, n_h, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, c.num_heads * d)
        return self._linear(o, b + "attn_output.weight")

    def _block_mask(self, n: int, window: int | None) -> torch.Tensor:
        """bool [n, n]: block key i' visible to query i: causal 0 <= i-i' (< W), else |i-i'| < W (all without W)."""
        i = torch.arange(n)
        diff = i[:, None] - i[None, :]
        mask = diff >= 0 if self.config.causal else torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            mask = mask & (diff < window) & (-diff < window)
        return mask

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x fp32 [n, in] · W_nameᵀ -> [n, out]."""
        linear = self.linears.get(name)
        return x @ self.w[name].T if linear is None else linear(x)

    def _rms(self, x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_eps)
