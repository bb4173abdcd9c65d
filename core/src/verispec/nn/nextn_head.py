"""The bookkeeping of a NextN / MTP draft head (one transformer block after the trunk, drafting
one token per step from the trunk's last hidden row), shared by the families that have one.

A family's head subclasses `NextNHead` and writes `forward_rows` (its block's math); this module
holds what is the same for all of them. Per-sequence state (`NextNState`): the head's KV cache
(one entry per NextN position, computed from *trunk* hidden rows), the pairs (token, trunk hidden)
committed but not yet run, and the trunk hidden row of the last committed position. Catch-up is
folded into the first draft step: `draft_catch_up` only queues pairs, and the next `draft_step`
runs queued pairs + its own row as one forward. Entries written by chained steps are provisional:
`keep` (and the next step) drop them. A commit without hidden rows, or at a position the head did
not expect, is a gap: the head restarts its KV from the next pair it can form
(`draft_head_resumes_after_gap`: its drafts attend over less context until the KV refills, never
over rows that are not the sequence's, and the loop verifies every draft).

Position convention (llama.cpp's and transformers'): the pair (token t, trunk row h of the
position before t) sits at t's position.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.nn.kv_cache import HeadKVCache
from verispec.seams import DraftHeadKind

__all__ = ["NextNHead", "NextNState"]


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


class NextNHead:
    """PER_TOKEN draft head over a trunk's NextN block (final-normed taps: tap_layers None); reads
    the trunk only through its view (embedding, LM head) and the block's own weights. Subclasses
    write `forward_rows`.

    trunk: the served trunk (its `view()`, `config` with num_key_value_heads and head_dim, and
    `model.rotary_emb`); mtp: the NextN block module (default `trunk.mtp`).
    """

    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True
    tap_layers = None

    def __init__(self, trunk, mtp=None):
        self.mtp = trunk.mtp if mtp is None else mtp
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

    def draft_block(self, state, last_token, h_prev, pos, num_rows=None):
        raise NotImplementedError("a NextN head drafts one token per step (PER_TOKEN)")

    def keep(self, state: NextNState, num_rows: int) -> None:
        state.kv.drop_from(state.num_valid)  # chained steps' rows were provisional

    def forward_rows(self, kv: HeadKVCache, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int):
        """The block over m consecutive pairs at positions start_pos..: tokens [m], trunk or head
        hidden fp32 [m, D]. Writes their K/V to `kv`; returns (logits fp32 [1, V] of the last row,
        h' fp32 [m, D])."""
        raise NotImplementedError
