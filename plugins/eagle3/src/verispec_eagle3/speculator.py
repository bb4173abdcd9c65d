"""The `eagle3` speculator: chains an EAGLE-3 head's test-time recurrence, one token per step.

A round, with the pending token x at position p and the trunk's taps h of position p - 1
(`DraftContext.hidden_prev`, the residuals entering the head's three target layers):

    logits, g1 = head.draft_step(state, x, h, p)        # fc(h); runs the queued catch-up rows first
    d1 = argmax(logits)                                  # kept if its gate passes
    logits, g2 = head.draft_step(state, d1, g1, p + 1)   # the head's own pre-norm row, not the trunk's
    ...

The gate (--spec-pmin, default 0.15, `SPEC.default_min_draft_prob`): the top-1 probability of a
softmax over the step's ten largest logits (`verispec.draft_gate`, the one every per-token
drafter here uses; d2t's -inf rows never reach it). The default is mtp's and was not measured on a
trained EAGLE-3 head (none exists here yet). Drafting also stops after a drafted stop token and at
K = `ctx.max_draft_tokens` (the loop's bound, never narrowed here); a pending stop token gets no
draft. Greedy argmax drafts: the loop's acceptance keeps the output exact for any sampler.

`commit` hands committed tokens and their taps to `head.draft_catch_up`, `keep` to `head.keep`.
`prepare` runs the queued committed rows when there are more than one verify could have committed
(K + 1: a prompt, or a stretch decoded while parked): one-off work the governor does not count as
drafting; the rows of the last verify stay folded into the round's first step, as in llama.cpp.
"""
from __future__ import annotations

from typing import Any

from verispec.draft_gate import greedy_chain
from verispec.seams import DraftContext, HeadSpeculator

from verispec_eagle3.hooks import SPEC


class Eagle3Speculator(HeadSpeculator):
    """Drafts by chaining `Eagle3Head.draft_step` (module docstring)."""

    def __init__(self, head, spec=SPEC, **kwargs):
        super().__init__(head, spec, **kwargs)

    def prepare(self, state: Any, ctx: DraftContext) -> None:
        if len(state.pending) > ctx.max_draft_tokens + 1:
            self.head.flush(state)

    def propose(self, state: Any, ctx: DraftContext) -> list[int]:
        return greedy_chain(lambda token, hidden, j: self.head.draft_step(state, token, hidden, ctx.pos + j), ctx)


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: None (a silent decline: it does not take that drafter) unless --draft-model
    loaded an EAGLE-3 head."""
    from verispec_eagle3.head import Eagle3Head

    if not isinstance(draft_head, Eagle3Head):
        return None
    return Eagle3Speculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
