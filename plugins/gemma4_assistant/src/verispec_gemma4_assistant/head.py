"""The assistant as a PER_TOKEN `DraftHead` over the trunk's own KV.

A draft round at query position p (the pending token's position; the trunk has committed
0 .. p-1) reads the trunk's K/V once (`read_kv`) and chains steps on it (`step`): the first on
(pending token, the trunk's final-normed row of p-1), each next one on (its draft, the previous
step's h_next), every step at the same position p. Only committed positions are attended (a
rejected verify row is never seen); sliding layers see the last W + 1 of them (transformers'
rule: docs/reference/gemma4.md §4.2, the one setting below), full layers all.

Per-sequence state holds nothing the trunk does not: `AssistantState` names the trunk
sequence and nothing else, so the head drafts from any position after any gap (prefix reuse, a
batched interlude, a parked stretch): `draft_catch_up` and `keep` have nothing to do.
"""
from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from verispec.seams import DraftHeadKind
from verispec_gemma4.modeling_gemma4 import SLIDING

from verispec_gemma4_assistant.binding import kv_layer
from verispec_gemma4_assistant.modeling import KV, Gemma4Assistant

__all__ = ["AssistantState", "Gemma4AssistantHead", "SLIDING_EXTRA_POSITIONS"]

#: sliding layers see window + this many committed positions (HF: the last W + 1 KV entries;
#: a causal reading at query position p would be W - 1).
SLIDING_EXTRA_POSITIONS = 1


@attrs.define
class AssistantState:
    """The trunk sequence a `draft_step` reads (set by the speculator before a round); None = unset."""

    seq: int | None = None


class Gemma4AssistantHead:
    """PER_TOKEN draft head: `model` (Gemma4Assistant) bound to `trunk` (a Gemma 4 trunk whose
    sizes `binding.binding_problem` accepted). centroids: score with the centroid head (the file
    must have one) instead of the dense tied head."""

    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True
    tap_layers = None  # the trunk's final-normed rows

    def __init__(self, model: Gemma4Assistant, trunk, *, centroids: bool = False, path: str = ""):
        self.model, self.config, self.path = model, model.config, path
        self.view = trunk.view()
        self.centroids = centroids
        self.kv_layers = {kind: kv_layer(trunk.config, kind) for kind in set(self.config.layer_types)}

    def new_state(self) -> AssistantState:
        return AssistantState()

    @torch.no_grad()
    def read_kv(self, seq: int, pos: int) -> dict[str, KV]:
        """The trunk's K/V a round at query position `pos` attends, per layer type (views of the
        trunk's cache where it allows: use them before the trunk's next forward). Committed
        positions only; sliding: from pos - W - 1 on. Cost: the attended slots, not the context
        (trunk_view.Gemma4TrunkView.kv_window); other views fall back to `TrunkView.kv`."""
        out = {}
        for kind, layer in self.kv_layers.items():
            first = max(0, pos - self.config.sliding_window - SLIDING_EXTRA_POSITIONS) if kind == SLIDING else 0
            window = getattr(self.view, "kv_window", None)
            if window is not None:
                out[kind] = window(seq, layer, first)
            else:
                k, v, positions = self.view.kv(seq, layer)
                out[kind] = [(k, v, torch.where(positions >= first, positions, -1))]
        return out

    @torch.no_grad()
    def step(self, kv: dict[str, KV], token: int, hidden: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step at query position `pos` over `kv` (from `read_kv`): token id, hidden
        fp32 [D] (the trunk's final-normed row of pos-1, or the previous step's h_next).
        Returns (logits fp32 [V] for the next draft, h_next fp32 [D])."""
        embedding = self.view.embed(torch.tensor([int(token)]))  # [1, D], × √D
        x = torch.cat([embedding, hidden.float().reshape(1, -1)], dim=-1)
        zn, h_next = self.model(x, kv, pos)
        return self.model.logits(zn, centroids=self.centroids)[0], h_next[0]

    def draft_step(self, state: AssistantState, token: int, h_prev: torch.Tensor, pos: int):
        """The seam's PER_TOKEN step for the sequence `state.seq` at query position `pos` (keep it
        for every step of a round). Returns (logits fp32 [V], h_next fp32 [D]). Raises ValueError
        when state.seq is unset: this head reads one sequence's KV; the gemma4-assistant
        speculator (--spec-type draft-head) names it."""
        if state is None or state.seq is None:
            raise ValueError("the Gemma 4 assistant reads the trunk's KV of one sequence and no sequence was set; "
                             "drive it with --spec-type draft-head (the gemma4-assistant speculator)")
        return self.step(self.read_kv(state.seq, pos), token, h_prev, pos)

    def draft_block(self, state, last_token, h_prev, pos, num_rows=None):
        raise NotImplementedError("a PER_TOKEN head drafts one token per step (draft_step)")

    def draft_catch_up(self, state: AssistantState, tokens: Sequence[int], h_rows, start_pos: int) -> None:
        """Nothing to catch up: the head holds no KV of its own."""

    def keep(self, state: AssistantState, num_rows: int) -> None:
        """Nothing to drop: the trunk's `keep` already removed rejected rows from what `read_kv` sees."""
