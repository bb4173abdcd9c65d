"""`DFlashHead`: a DFlash/DFlash2 drafter as a BLOCK `seams.DraftHead` bound to one trunk.

Per sequence (`new_state`): one `ContextRing` per drafter layer, the committed length the head has
accounted for, and the anchor position of its last block. The loop's calls map onto the passes
(reference note §7.6):

- `draft_catch_up(state, tokens, h_rows, start_pos)`: committed rows (prompt chunks, batched
  decode rows, accepted verify rows) with their trunk taps h_rows fp32 [n, T·H] -> Pass A + B,
  deferred: the rows wait in `state.pending` and go through Pass A + B in one batched call when
  the next block needs them (or once `MAX_PENDING_ROWS` wait). A head the governor has parked thus
  costs a copy of the taps per committed row, not a drafter forward per step; bits of the ring may
  depend on how rows were batched (drafts only, never outputs). `tokens` are not read (DFlash
  never sees token ids as context). h_rows None (rows the loop has
  no taps for: a reused prefix after `seed_committed`) only advances the length: those positions
  stay missing from the ring, which lowers acceptance until newer rows fill it (a full-attention
  drafter keeps the hole), never correctness.
- `draft_block(state, last_token, h_prev, pos, num_rows=None)`: Pass C on `[last_token, mask…]` at
  positions pos.., readout of rows 1.. through the trunk's LM head (`TrunkView.logits`), DFlash1
  argmax or the DFlash2 walk. Returns the drafts for positions pos+1.. and the cumulative prefix
  confidence of each. `h_prev` is not read.
- `keep(state, num_rows)`: the trunk kept `num_rows` rows of the verify at the last anchor: ring
  rows at positions >= anchor + num_rows are dropped (none are there in the loop's order, where
  only committed rows are written; a caller injecting a whole verify first is covered too).

The block's input rows are the trunk's input embedding (`TrunkView.embed`) times
`dflash.embedding_scale`: the raw table for llama/qwen targets (the torch reference's choice);
a Gemma target's embedding includes its √D scale (what the MLX reference does; Gemma drafts are
not published). The LM head is the trunk's (with its own final softcap, if any), then the
drafter's transform.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from verispec.seams import DraftHeadKind

from verispec_dflash.drafter import DFlashDrafter
from verispec_dflash.ring import ContextRing
from verispec_dflash.selector import argmax_drafts, walk_drafts


@attrs.define
class DFlashState:
    """What the head holds of one sequence."""

    rings: list[ContextRing]
    #: positions the head has accounted for (the next committed row goes there).
    length: int = 0
    #: anchor position of the last draft_block (the verify's first row), or None.
    anchor: int | None = None
    #: committed rows not yet through Pass A + B: (start position, taps fp32 [n, T·H]), ascending.
    pending: list[tuple[int, torch.Tensor]] = attrs.field(factory=list)


#: committed rows a state holds back before it runs their Pass A + B anyway (bounds the taps held).
MAX_PENDING_ROWS = 256


class DFlashHead:
    """BLOCK draft head over a `DFlashDrafter` and a trunk's `TrunkView` (module docstring)."""

    draft_head_kind = DraftHeadKind.BLOCK
    draft_head_resumes_after_gap = True

    def __init__(self, drafter: DFlashDrafter, view, *, max_context: int, path: str = ""):
        self.drafter, self.view, self.path = drafter, view, path
        self.config = drafter.config
        self.tap_layers: tuple[int, ...] = self.config.target_layers
        self.draft_block_size = self.config.block_size
        self.max_context = max_context
        self.feature_size = view.tap_feature_size(self.tap_layers)

    def new_state(self) -> DFlashState:
        return DFlashState(self.drafter.new_rings(self.max_context))

    # -- commits --------------------------------------------------------------------------------

    def draft_catch_up(self, state: DFlashState, tokens: Sequence[int], h_rows, start_pos: int) -> None:
        n = len(tokens) if h_rows is None else h_rows.shape[0]
        if start_pos < state.length:  # rows re-committed after a rewind: forget what followed
            self.rewind(state, start_pos)
        if h_rows is not None and n:
            if h_rows.shape[-1] != self.feature_size:
                raise ValueError(f"tap rows are {h_rows.shape[-1]} wide, the drafter reads {self.feature_size}")
            state.pending.append((start_pos, h_rows.detach().float().clone()))
            if sum(rows.shape[0] for _, rows in state.pending) >= MAX_PENDING_ROWS:
                self.flush(state)
        state.length = max(state.length, start_pos + n)

    def flush(self, state: DFlashState) -> None:
        """Pass A + B of the pending committed rows, one batched call per contiguous run."""
        runs: list[tuple[int, list[torch.Tensor]]] = []
        end = None  # the position after the current run
        for start, rows in state.pending:
            if start != end:
                runs.append((start, []))
            runs[-1][1].append(rows)
            end = start + rows.shape[0]
        state.pending.clear()
        for start, parts in runs:
            self.drafter.inject(state.rings, torch.cat(parts), start)

    def keep(self, state: DFlashState, num_rows: int) -> None:
        if state.anchor is None:
            return
        self.rewind(state, state.anchor + num_rows)
        state.anchor = None

    def rewind(self, state: DFlashState, length: int) -> None:
        """Forget positions >= length (rings, pending rows and length)."""
        state.pending = [(start, rows[:length - start]) for start, rows in state.pending if start < length]
        for ring in state.rings:
            ring.drop_from(length)
        state.length = min(state.length, length)

    # -- drafting -------------------------------------------------------------------------------

    @torch.no_grad()
    def block_logits(self, state: DFlashState, last_token: int, pos: int, num_rows: int | None = None):
        """(z fp32 [n, H] post-norm block rows, transformed logits fp32 [n-1, V] of rows 1..n-1)
        for the block anchored at `pos`; n = num_rows (2..B), default B."""
        n = self.draft_block_size if num_rows is None else num_rows
        if not 2 <= n <= self.draft_block_size:
            raise ValueError(f"a block has 2..{self.draft_block_size} rows, asked for {n}")
        self.flush(state)
        ids = torch.tensor([last_token] + [self.config.mask_token_id] * (n - 1))
        embeddings = self.view.embed(ids).float()
        if self.config.embedding_scale != 1.0:
            embeddings = embeddings * self.config.embedding_scale
        z = self.drafter.block_hidden(state.rings, embeddings, pos)
        return z, self.drafter.transform(self.view.logits(z[1:]).float())

    def draft_block(self, state: DFlashState, last_token: int, h_prev, pos: int,
                    num_rows: int | None = None) -> tuple[list[int], list[float]]:
        state.anchor = pos
        z, logits = self.block_logits(state, last_token, pos, num_rows)
        if self.drafter.use_selector:
            w = self.drafter.w
            ids, confs = walk_drafts(logits, z[1:], last_token, top_k=self.config.selector_top_k,
                                     projection=w["selector_hidden.weight"],
                                     predecessor=w["selector_predecessor.weight"],
                                     successor=w["selector_successor.weight"])
        else:
            ids, confs = argmax_drafts(logits)
        cumulative, running = [], 1.0
        for conf in confs:
            running *= conf
            cumulative.append(running)
        return ids, cumulative

    def draft_step(self, state: Any, token: int, h_prev, pos: int):
        raise NotImplementedError("a DFlash head drafts whole blocks (draft_block)")
