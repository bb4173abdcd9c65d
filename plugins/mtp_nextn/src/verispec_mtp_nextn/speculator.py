"""The `mtp` speculator: chain a PER_TOKEN draft head one token per step.

A step, with the pending token x at position p and the trunk's tapped row h of position p-1
(`DraftContext.hidden_prev`):

    logits, h1 = head.draft_step(state, x, h, p)        # also runs the head's catch-up rows
    d1 = argmax(logits)                                  # kept if its gate passes
    logits, h2 = head.draft_step(state, d1, h1, p + 1)   # chained on the head's own row
    ...

The gate (--spec-pmin, default 0.15; `verispec.draft_gate`): the top-1 probability of a softmax
over the step's ten largest logits; drafting stops at the first step below it. It stops after a stop token (the stop is drafted) and at K (`ctx.max_draft_tokens`); a pending
stop token gets no draft. Greedy argmax drafts: the loop's acceptance keeps the output exact
for any sampler.

Per-sequence state is the head's (`head.new_state()`): its private KV and the rows it has been
told about. `commit` hands the kept tokens and their trunk rows to `head.draft_catch_up` (the
head folds them into its next first step), `keep` tells the head how many verify rows stayed.
Works with any PER_TOKEN head: Qwen 3.5/3.6 MTP today, GLM NextN later.
"""
from __future__ import annotations

from typing import Any

from verispec.draft_gate import greedy_chain
from verispec.seams import DraftContext, DraftHeadKind, HeadSpeculator

from verispec_mtp_nextn.hooks import SPEC


class MtpSpeculator(HeadSpeculator):
    """Drafts by chaining a PER_TOKEN `DraftHead` (see the module docstring)."""

    head_kind = DraftHeadKind.PER_TOKEN

    def __init__(self, head, spec=SPEC, **kwargs):
        super().__init__(head, spec, **kwargs)

    def propose(self, state: Any, ctx: DraftContext) -> list[int]:
        return greedy_chain(lambda token, hidden, j: self.head.draft_step(state, token, hidden, ctx.pos + j), ctx)


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: None (declined) unless the trunk offers a PER_TOKEN head."""
    if draft_head is None or draft_head.draft_head_kind is not DraftHeadKind.PER_TOKEN:
        return None
    return MtpSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
