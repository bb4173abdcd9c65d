"""The GLM-4.x NextN (MTP) block as a PER_TOKEN `DraftHead` bound to its trunk.

One draft step (docs/reference/glm5-nemotron.md §3.5; transformers modeling_layers.MtpLayer), for a
hidden row h [D] and the token t that follows the position h came from, at NextN position p (the
token's position: llama.cpp's and transformers' convention):
    x  = eh_proj( [enorm(embed(t)) ‖ hnorm(h)] )               embedding first, then hidden
    x  = x + attn(input_layernorm(x))                          the head's own KV, partial NeoX RoPE
    x  = x + moe(post_attention_layernorm(x))                  routed experts + shared expert
    h' = post_norm(x);  logits = lm_head(h')                   shared_head_norm; h' feeds the next step
`embed` / `lm_head` are the block's own nextn.embed_tokens / nextn.shared_head_head where the file
has them, else the trunk's (GLM-4.5/4.6 files omit both). The first step of a draft reads the
trunk's final-normed row of the last committed position; chained steps read the head's own h'.

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

__all__ = ["Glm4MoeNextNHead"]


class Glm4MoeNextNHead(NextNHead):
    """The NextN draft head of a GLM-4.x trunk over its `mtp` block (`Glm4MoeNextN`).

    `draft_head_resumes_after_gap` is True: the head's only state is its own attention KV over
    the pairs it was shown, so after tokens committed without hidden rows (a reused prefix) or at
    a position it did not expect, it drops that KV and restarts from the next (token, trunk row)
    pair it can form. Its drafts then attend over less context until the KV fills again (lower
    acceptance for a while), never over rows that do not belong to the sequence; and the loop
    verifies every draft, so the output stays exact.
    """

    def forward_rows(self, kv: HeadKVCache, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int):
        """The NextN block over m consecutive pairs at positions start_pos..: tokens [m], trunk or head
        hidden fp32 [m, D]. Writes their K/V to `kv`; returns (logits fp32 [1, V] of the last row,
        h' [m, D])."""
        mtp, m = self.mtp, len(tokens)
        positions = torch.arange(start_pos, start_pos + m)
        cos, sin = self.rotary_emb.cos_sin(positions)
        ids = torch.tensor(tokens)
        e = self.view.embed(ids) if mtp.embed_tokens is None else mtp.embed_tokens.rows(ids)  # [m, D]
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))
        scaling = mtp.mtp_block.self_attn.scaling

        def attend_head(q, k, v):
            kv.write(start_pos, k, v)
            return attend(q, kv, start_pos, scaling=scaling)

        x = mtp.mtp_block(x, self.rotary_emb, cos, sin, attend_head)
        h_out = mtp.post_norm(x)
        last = h_out[-1:]
        return (self.view.logits(last) if mtp.shared_head is None else mtp.shared_head(last)), h_out
