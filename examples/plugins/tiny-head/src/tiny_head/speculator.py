"""TinyHeadSpeculator: chains the head from ctx.hidden_prev, one token per step, while its top-1
probability clears the gate."""
from __future__ import annotations

import torch

from verispec.seams import Speculator


class TinyHeadSpeculator(Speculator):
    def __init__(self, head, spec, **kwargs):
        super().__init__(spec, **kwargs)
        self.head = head
        self.tap_layers = head.tap_layers  # the rows the loop asks the trunk for

    def new_state(self):
        return self.head.new_state()

    def propose(self, state, ctx) -> list[int]:
        if ctx.last_token in ctx.stop_token_ids or ctx.hidden_prev is None:  # None: nothing forwarded yet
            return []
        draft, token, h = [], ctx.last_token, ctx.hidden_prev  # h: the row at ctx.pos - 1, [D]
        for i in range(ctx.max_draft_tokens):  # the loop's bound: no ceiling of our own
            logits, h = self.head.draft_step(state, token, h, ctx.pos + i)
            probs = torch.softmax(logits, dim=0)
            token = int(probs.argmax())
            if float(probs[token]) < ctx.min_draft_prob:
                break
            draft.append(token)
            if token in ctx.stop_token_ids:  # a draft ends at a stop id
                break
        return draft

    def commit(self, state, tokens, hidden_rows, start_pos) -> None:
        self.head.draft_catch_up(state, tokens, hidden_rows, start_pos)  # rows [n, D]; None after a reused prefix

    def keep(self, state, num_rows) -> None:
        self.head.keep(state, num_rows)


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: None (a silent decline) unless --draft-model loaded a tiny-head file."""
    from tiny_head.head import TinyHead

    if not isinstance(draft_head, TinyHead):
        return None
    return TinyHeadSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
