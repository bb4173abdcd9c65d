"""The GLM-5.x NextN (MTP) block as a PER_TOKEN `DraftHead` bound to its glm-dsa trunk.

One draft step (docs/reference/glm5-nemotron.md §3.5, §5.6; transformers modeling_layers.MtpLayer
over a GlmMoeDsaDecoderLayer), for a hidden row h [D] and the token t that follows the position h
came from, at NextN position p (the token's position):
    x  = eh_proj( [enorm(embed(t)) ‖ hnorm(h)] )          embedding first, then hidden
    x  = x + mla(input_layernorm(x))                      the head's own latent rows and indexer
                                                          keys; top-k keys from its own indexer
    x  = x + moe(post_attention_layernorm(x))
    h' = post_norm(x);  logits = lm_head(h')
The head's indexer selects among the head's own keys, as its layer does in transformers' MtpLayer
(llama.cpp's draft graph runs the block's MLA dense instead; the two agree while the head holds
at most index_topk positions, §12.6). The bookkeeping is core's `nn.nextn_head.NextNHead`.

Shape letters: m rows in one head forward, D width, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from verispec.nn.nextn_head import NextNHead, NextNState
from verispec.nn.trunk import RowsOfSequence

from verispec_glm5.mla import MlaHeadCache

__all__ = ["GlmDsaNextNHead"]


class GlmDsaNextNHead(NextNHead):
    """The NextN draft head of a glm-dsa trunk over its `mtp` block (`GlmDsaNextN`).

    `draft_head_resumes_after_gap` is True: the head's only state is its own latent rows and
    indexer keys over the pairs it was shown, one contiguous run of positions; after tokens
    committed without hidden rows (a reused prefix) or at a position it did not expect, it drops
    the run and restarts it at the next (token, trunk row) pair it can form. Its drafts then attend
    over less context until the run refills, never over rows that do not belong to the sequence;
    the loop verifies every draft, so the output stays exact.
    """

    def new_state(self) -> NextNState:
        c = self.config
        return NextNState(MlaHeadCache(c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim))

    def forward_rows(self, kv: MlaHeadCache, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int):
        """The NextN block over m consecutive pairs at positions start_pos..: tokens [m], trunk or head
        hidden fp32 [m, D]. Writes their latent rows and indexer keys to `kv`; returns (logits fp32
        [1, V] of the last row, h' [m, D])."""
        mtp, m = self.mtp, len(tokens)
        cos, sin = self.rotary_emb.cos_sin(torch.arange(start_pos, start_pos + m))
        ids = torch.tensor(tokens)
        e = self.view.embed(ids) if mtp.embed_tokens is None else mtp.embed_tokens.rows(ids)  # [m, D]
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))
        rows = RowsOfSequence(state=None, start_pos=start_pos, begin=0, end=m)
        x, _ = mtp.mtp_block(x, cos, sin, [kv], [rows], None)
        h_out = mtp.post_norm(x)
        last = h_out[-1:]
        return (self.view.logits(last) if mtp.shared_head is None else mtp.shared_head(last)), h_out
