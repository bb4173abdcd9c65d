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

Per-sequence state (`NextNState`): the head's KV cache (one entry per NextN position, computed
from *trunk* hidden rows), the pairs (token, trunk hidden) committed but not yet run, and the
trunk hidden row of the last committed position. Catch-up is folded into the first draft step:
`draft_catch_up` only queues pairs, and the next `draft_step` runs queued pairs + its own row as
one forward. Entries written by chained steps are provisional: `keep` (and the next step) drop
them. The bookkeeping is the Qwen 3.5 MTP head's (verispec_qwen35.draft_head); only the block differs.

Shape letters: m rows in one head forward, D width, V vocabulary, Hkv / Dh as the trunk.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from verispec.nn.attention import attend
from verispec.nn.kv_cache import HeadKVCache
from verispec.seams import DraftHeadKind

__all__ = ["Glm4MoeNextNHead", "NextNState"]


class NextNState:
    """What the head holds of one sequence."""

    def __init__(self, kv: HeadKVCache):
        self.kv = kv
        #: committed positions the head has been told about (the pending token sits here).
        self.num_seen = 0
        #: NextN positions [.., num_valid) hold entries computed from trunk hidden rows.
        self.num_valid = 0
        #: trunk hidden row [D] of position num_seen - 1, or None after a gap.
        self.last_hidden: torch.Tensor | None = None
        #: committed pairs not yet run: (position, token, trunk hidden of position - 1), consecutive.
        self.pending: list[tuple[int, int, torch.Tensor]] = []


class Glm4MoeNextNHead:
    """PER_TOKEN draft head over the trunk's `mtp` block (`Glm4MoeNextN`); reads the trunk only
    through its view (embedding, LM head) and the NextN weights it owns. Final-normed taps.

    `draft_head_resumes_after_gap` is True: the head's only state is its own attention KV over
    the pairs it was shown, so after tokens committed without hidden rows (a reused prefix) or at
    a position it did not expect, it drops that KV and restarts from the next (token, trunk row)
    pair it can form. Its drafts then attend over less context until the KV fills again (lower
    acceptance for a while), never over rows that do not belong to the sequence; and the loop
    verifies every draft, so the output stays exact.
    """

    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True
    tap_layers = None

    def __init__(self, trunk):
        self.mtp = trunk.mtp
        self.view = trunk.view()
        self.rotary_emb = trunk.model.rotary_emb
        self.config = trunk.config
        self.feature_size = self.view.tap_feature_size(self.tap_layers)

    def new_state(self) -> NextNState:
        return NextNState(HeadKVCache(self.config.num_key_value_heads, self.config.head_dim))

    def draft_catch_up(self, state: NextNState, tokens: Sequence[int], h_rows, start_pos: int) -> None:
        tokens = [int(t) for t in tokens]
        if h_rows is None or start_pos != state.num_seen:  # a gap: restart from the next full pair
            state.kv.drop_from(0)
            state.pending, state.num_valid = [], 0
            state.last_hidden = None if h_rows is None else h_rows[-1].float()
            state.num_seen = start_pos + len(tokens)
            if h_rows is not None:
                state.pending = [(start_pos + j, tokens[j], h_rows[j - 1].float())
                                 for j in range(1, len(tokens))]
            return
        for j, token in enumerate(tokens):
            pos = start_pos + j
            hidden = state.last_hidden if j == 0 else h_rows[j - 1].float()
            if pos >= state.num_valid and hidden is not None:  # pos < num_valid: run as a first draft step
                state.pending.append((pos, token, hidden))
        state.last_hidden = h_rows[-1].float()
        state.num_seen = start_pos + len(tokens)

    @torch.no_grad()
    def draft_step(self, state: NextNState, token: int, h_prev: torch.Tensor, pos: int):
        """Logits fp32 [V] for position pos+1 and the head's normed row h' [D]. When pos is the
        pending position (h_prev is the trunk's row) the queued catch-up rows run in the same forward."""
        rows = [(pos, int(token), h_prev.float())]
        first = pos == state.num_seen
        if first:
            rows = [r for r in state.pending if r[0] < pos] + rows
            state.pending = []
            state.kv.drop_from(rows[0][0])  # provisional rows of the last draft are gone
        hidden = torch.stack([r[2] for r in rows])  # [m, D]
        logits, h_out = self.forward_rows(state.kv, [r[1] for r in rows], hidden, rows[0][0])
        if first:
            state.num_valid = pos + 1
        return logits[-1], h_out[-1]

    def draft_block(self, state, last_token, h_prev, pos):
        raise NotImplementedError("the NextN head drafts one token per step (PER_TOKEN)")

    def keep(self, state: NextNState, num_rows: int) -> None:
        state.kv.drop_from(state.num_valid)  # chained steps' rows were provisional

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
