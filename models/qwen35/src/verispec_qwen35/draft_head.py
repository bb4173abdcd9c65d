"""The Qwen 3.5 / 3.6 MTP (NextN) block as a PER_TOKEN `DraftHead` bound to its trunk.

One draft step (docs/reference/qwen35.md §7.1), for a hidden row h [D] and the token t that follows
the position h came from, at MTP position p (the token's position: llama.cpp's convention):
    x  = fc( [enorm(embed(t)) ‖ hnorm(h)] )                    embedding first, then hidden
    x  = x + attn(input_layernorm(x))                          the head's own KV, partial RoPE, gate
    x  = x + ffn(post_attention_layernorm(x))                  dense or MoE + shared, as the trunk
    h' = norm(x);  logits = lm_head(h')                        trunk's LM head; h' feeds the next step
The first step of a draft reads the trunk's final-normed row of the last committed position;
chained steps read the head's own h'.

The bookkeeping (per-sequence state, catch-up folded into the first draft step, provisional
chained rows, gaps) is core's `verispec.nn.nextn_head.NextNHead`; this module is the block.

Shape letters: m rows in one head forward, D width, V vocabulary, Hkv / Dh as the trunk.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from verispec.nn.attention import attend
from verispec.nn.kv_cache import HeadKVCache
from verispec.nn.nextn_head import NextNHead

__all__ = ["Qwen35MtpHead"]


class Qwen35MtpHead(NextNHead):
    """The MTP draft head of a Qwen 3.5 trunk: `mtp` is its `Qwen35Mtp` block (default: the
    trunk's own, from a main file that holds one)."""

    def forward_rows(self, kv: HeadKVCache, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int):
        """The MTP block over m consecutive pairs at positions start_pos..: tokens [m], trunk or head
        hidden fp32 [m, D]. Writes their K/V to `kv`; returns (logits fp32 [1, V] of the last row,
        h' [m, D])."""
        mtp, m = self.mtp, len(tokens)
        positions = torch.arange(start_pos, start_pos + m)
        cos, sin = self.rotary_emb.cos_sin(positions)
        e = self.view.embed(torch.tensor(tokens))  # [m, D]
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        attn = mtp.layer.self_attn

        def attend_head(q, k, v):
            kv.write(start_pos, k, v)
            return attend(q, kv, start_pos, scaling=attn.scaling)

        x = mtp.layer(x, lambda y: attn(y, self.rotary_emb, cos, sin, attend_head))
        h_out = mtp.norm(x)
        return self.view.logits(h_out[-1:]), h_out
