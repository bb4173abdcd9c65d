"""The `dflash` speculator (what `--spec-type block` picks): one BLOCK draft head's block per step, cut at K and by the gate.

A step with the pending token a at position p (`DraftContext.last_token`, `.pos`) and K drafts at most (`ctx.max_draft_tokens`):

    ids, cum = head.draft_block(state, a, None, p, num_rows=min(B, K + 1))   # one drafter forward
    draft = ids[:j], j = the first e with cum[e] < --spec-pmin (default 0.35), at most K,
            cut after a stop token (the stop is drafted); a pending stop token gets no draft.

cum[e] is the cumulative prefix confidence (the product of the row confidences up to e; DFlash1:
softmax of the row's logits at the draft, DFlash2: within the row's K candidates). The block has
K + 1 rows (anchor + K masks) when K is smaller than the trained block size B: running
fewer rows is legal (training decays the loss by block position), and cheaper; llama.cpp does the
same with --spec-draft-n-max.

`commit` hands committed rows and their taps to `head.draft_catch_up` (Pass A + B), `keep` to
`head.keep`. Works with any BLOCK head on the `DraftHead` seam.
"""
from __future__ import annotations

from typing import Any

from verispec.seams import DraftContext, DraftHeadKind, HeadSpeculator

from verispec_dflash.hooks import SPEC


class BlockSpeculator(HeadSpeculator):
    """Proposes a BLOCK head's draft (module docstring)."""

    head_kind = DraftHeadKind.BLOCK

    def __init__(self, head, spec=SPEC, **kwargs):
        super().__init__(head, spec, **kwargs)

    def propose(self, state: Any, ctx: DraftContext) -> list[int]:
        if ctx.last_token in ctx.stop_token_ids:
            return []
        k = min(ctx.max_draft_tokens, self.head.draft_block_size - 1)
        if k < 1:
            return []
        ids, cumulative = self.head.draft_block(state, ctx.last_token, ctx.hidden_prev, ctx.pos, num_rows=k + 1)
        draft: list[int] = []
        for token, confidence in zip(ids[:k], cumulative):
            if confidence < ctx.min_draft_prob:
                break
            draft.append(int(token))
            if token in ctx.stop_token_ids:
                break
        return draft


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: None (declined) unless a BLOCK head was loaded for the trunk."""
    if draft_head is None or getattr(draft_head, "draft_head_kind", None) is not DraftHeadKind.BLOCK:
        return None
    return BlockSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
