"""The `gemma4-assistant` speculator: drafts with a Gemma 4 assistant head, k steps at one position.

A round, with the pending token x at position p and the trunk's final-normed row h of p-1
(`DraftContext.hidden_prev`): the trunk's K/V is read once (`head.read_kv(seq, p)`), then

    logits, h = head.step(kv, x, h, p);   d1 = argmax(logits)     # kept if its gate passes
    logits, h = head.step(kv, d1, h, p);  d2 = argmax(logits)     # same position, same K/V
    ...

Why not `mtp`: a chained step keeps the query position and reads one sequence's K/V, which
the generic PER_TOKEN chain does not name. The gate (--spec-pmin, default 0.15) is mtp's: the
top-1 probability of a softmax over the step's ten largest logits; drafting also stops after a
drafted stop token and at K (`ctx.max_draft_tokens`); a pending stop token gets no draft. Greedy drafts.
Nothing is committed or kept: the head holds no state (its `draft_head_resumes_after_gap`).
"""
from __future__ import annotations

from typing import Any

from verispec.draft_gate import greedy_chain
from verispec.seams import DraftContext, HeadSpeculator

from verispec_gemma4_assistant.hooks import SPEC


class AssistantSpeculator(HeadSpeculator):
    """Drafts by chaining `Gemma4AssistantHead.step` at the pending token's position. Nothing to
    commit or keep: every round reads the trunk's committed K/V afresh (the head's no-ops)."""

    def __init__(self, head, spec=SPEC, **kwargs):
        super().__init__(head, spec, **kwargs)

    def propose(self, state: Any, ctx: DraftContext) -> list[int]:
        if ctx.hidden_prev is None or ctx.seq is None or ctx.last_token in ctx.stop_token_ids:
            return []
        state.seq = ctx.seq
        kv = self.head.read_kv(ctx.seq, ctx.pos)  # the trunk does not move while we draft
        return greedy_chain(lambda token, hidden, j: self.head.step(kv, token, hidden, ctx.pos), ctx)


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: None (declined) unless --draft-model loaded a Gemma 4 assistant."""
    from verispec_gemma4_assistant.head import Gemma4AssistantHead

    if not isinstance(draft_head, Gemma4AssistantHead):
        return None
    return AssistantSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
