"""`Eagle3Head`: an EAGLE-3 head as a PER_TOKEN `seams.DraftHead` bound to one trunk.

A row of the head is a pair (token t at position p, g of position p - 1) and sits at position
p - 1: the tap row's position, as llama.cpp places its decoder rows ("at memory position P the
pair (token[P+1], g_P)") and as EAGLE's and vLLM's drafters shift input ids left by one. Every row
of one sequence uses this convention, and RoPE scores depend on position differences only.

- Committed rows: g = fc(trunk taps of p - 1) (`Eagle3Layer.fuse`). Their K/V stay in the head's
  KV (`modeling.HeadKV`, one per sequence): slots [0, num_valid) hold rows computed from trunk
  taps, or nothing where the head had no taps (a gap).
- A draft round at the pending token's position p (`draft_step` with pos == the committed length):
  the committed pairs queued by `draft_catch_up` run first (batched, in chunks of
  ROWS_PER_FORWARD), then the row (pending token, fc(taps of p - 1)) at p - 1: both final, since the
  pending token is emitted. Its pre-norm output is the next step's g.
- Chained steps (pos > the committed length): the row (draft token, the previous step's pre-norm
  output) at pos - 1: the test-time recurrence. These rows are provisional: `keep` (and the next
  round) drop every slot from num_valid on, and the committed rows are rebuilt from the trunk's
  own taps when they are committed.
- `draft_head_resumes_after_gap` = True: a commit without taps (prefix reuse), at a position the
  head did not expect, or after a rewind leaves holes: positions without a row are not attended,
  drafts are weaker until the KV refills, never wrong (the loop verifies every draft).

Logits: output · rms_norm(out) over the draft vocabulary Vd (the head's `output`, else the trunk's
LM head), scattered through d2t into a [V] row that is -inf elsewhere (llama.cpp's ggml_set_rows).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from verispec.seams import DraftHeadKind

from verispec_eagle3.modeling import Eagle3Layer, HeadKV

__all__ = ["Eagle3Head", "Eagle3State", "MAX_PENDING_ROWS", "ROWS_PER_FORWARD"]

#: committed pairs a state holds back before it runs them anyway (bounds the taps held while parked).
MAX_PENDING_ROWS = 256
#: catch-up rows per decoder pass (bounds the [H, m, S] attention scores of a long prompt).
ROWS_PER_FORWARD = 64


class Eagle3State:
    """What the head holds of one sequence."""

    def __init__(self, kv: HeadKV):
        self.kv = kv
        #: committed positions the head has been told about (the pending token sits at num_seen).
        self.num_seen = 0
        #: KV slots [0, num_valid) hold rows computed from trunk taps (or holes).
        self.num_valid = 0
        #: trunk taps [3·Dt] of position num_seen - 1, or None after a gap.
        self.last_tap: torch.Tensor | None = None
        #: committed pairs not yet run: (position p of the token, token, trunk taps of p - 1).
        self.pending: list[tuple[int, int, torch.Tensor]] = []


class Eagle3Head:
    """PER_TOKEN draft head: `layer` (weights and math) bound to a trunk through `view`.

    embedding: the head's own token_embd fp32 [V, D], or None (the trunk's `view.embed`).
    The LM head is the layer's `lm_head` (the file's `output`), or the trunk's `view.logits` without one.
    d2t: int64 [Vd] absolute trunk ids of the draft rows, or None (Vd = V).
    """

    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True

    def __init__(self, layer: Eagle3Layer, view, *, vocab_size: int, embedding=None, d2t=None, path: str = ""):
        self.layer, self.config, self.view, self.path = layer, layer.config, view, path
        self.vocab_size = vocab_size  # V
        self.embedding, self.d2t = embedding, d2t
        self.tap_layers: tuple[int, ...] = self.config.target_layers
        self.feature_size = view.tap_feature_size(self.tap_layers)  # 3·Dt

    def new_state(self) -> Eagle3State:
        return Eagle3State(HeadKV(self.config.num_kv_heads, self.config.head_dim))

    # -- commits --------------------------------------------------------------------------------

    def draft_catch_up(self, state: Eagle3State, tokens: Sequence[int], h_rows, start_pos: int) -> None:
        """Queue the pairs these committed tokens complete: the token at P with the taps of P - 1
        (from `h_rows` [n, 3·Dt], or the state's last taps for the first token). A rewind
        (start_pos < num_seen) drops the rows from start_pos - 1 on; a commit past num_seen or
        without taps leaves holes."""
        tokens = [int(t) for t in tokens]
        if h_rows is not None and h_rows.shape[-1] != self.feature_size:
            raise ValueError(f"tap rows are {h_rows.shape[-1]} wide, the head reads {self.feature_size} "
                             f"(taps {list(self.tap_layers)})")
        previous = state.last_tap if start_pos == state.num_seen else None
        if start_pos < state.num_seen:  # re-committed rows: what followed start_pos - 1 is gone
            state.kv.drop_from(start_pos - 1)
            state.num_valid = min(state.num_valid, max(start_pos - 1, 0))
            state.pending = [row for row in state.pending if row[0] < start_pos]
        for j, token in enumerate(tokens):
            pos = start_pos + j
            tap = previous if j == 0 else (None if h_rows is None else h_rows[j - 1])
            if tap is not None and pos - 1 >= state.num_valid:
                state.pending.append((pos, token, tap.detach().float().clone()))
        state.last_tap = None if h_rows is None else h_rows[-1].detach().float().clone()
        state.num_seen = start_pos + len(tokens)
        if len(state.pending) >= MAX_PENDING_ROWS:
            self.flush(state)

    @torch.no_grad()
    def flush(self, state: Eagle3State) -> None:
        """Run the queued pairs (their rows' K/V into the state's KV), ROWS_PER_FORWARD at a time."""
        state.kv.drop_from(state.num_valid)  # provisional rows of the last round are gone
        rows, state.pending = state.pending, []
        for start in range(0, len(rows), ROWS_PER_FORWARD):
            chunk = rows[start:start + ROWS_PER_FORWARD]
            g = self.layer.fuse(torch.stack([tap for _, _, tap in chunk]))
            positions = torch.tensor([pos - 1 for pos, _, _ in chunk])
            self.layer(self.embed(torch.tensor([token for _, token, _ in chunk])), g, positions, state.kv)
            state.num_valid = max(state.num_valid, chunk[-1][0])

    def keep(self, state: Eagle3State, num_rows: int) -> None:
        """The trunk kept `num_rows` rows of its verify: the chained steps' rows were provisional."""
        state.kv.drop_from(state.num_valid)

    # -- drafting -------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_step(self, state: Eagle3State, token: int, h_prev: torch.Tensor, pos: int):
        """Logits fp32 [V] for position pos + 1 and the head's pre-norm row fp32 [D].

        pos == the committed length (the pending token's position): h_prev is the trunk's taps
        [3·Dt] of pos - 1, fused through fc; the queued catch-up rows run first. pos beyond it: h_prev
        is the previous step's pre-norm row [D]. Raises ValueError for a row of another width or a
        position before the committed length."""
        first = pos == state.num_seen
        if pos < state.num_seen or pos < 1:
            raise ValueError(f"an EAGLE-3 draft step at position {pos}, before the {state.num_seen} committed "
                             "positions: drafting starts at the pending token")
        want = self.feature_size if first else self.config.hidden_size
        if h_prev.shape[-1] != want:
            raise ValueError(f"draft step at position {pos} ({'taps' if first else 'chained'}) reads a "
                             f"{want}-wide row, got {h_prev.shape[-1]}")
        if first:
            self.flush(state)
            g = self.layer.fuse(h_prev.float().reshape(1, -1))
        else:
            g = h_prev.float().reshape(1, -1)
        out = self.layer(self.embed(torch.tensor([int(token)])), g, torch.tensor([pos - 1]), state.kv)
        if first:
            state.num_valid = max(state.num_valid, pos)
        return self.logits(self.layer.normed(out))[0], out[0]

    def draft_block(self, state, last_token, h_prev, pos, num_rows=None):
        raise NotImplementedError("an EAGLE-3 head drafts one token per step (draft_step)")

    # -- the borrowed or own tables ---------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embedding rows fp32 [m, D]: the head's own table, else the trunk's."""
        if self.embedding is not None:
            return self.embedding[tokens]
        return self.view.embed(tokens).float()

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 [m, V] over normed rows fp32 [m, D]: draft rows scattered through d2t, -inf elsewhere."""
        lm_head = self.layer.lm_head
        draft = lm_head(normed).float() if lm_head is not None else self.view.logits(normed).float()
        if self.d2t is None:
            return draft
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        full[:, self.d2t] = draft
        return full
