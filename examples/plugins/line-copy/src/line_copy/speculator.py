"""LineCopy: when the current line so far matches the start of an earlier line, propose the rest
of that earlier line (up to its newline). Quoting, lists and code repeat lines; nothing else is
drafted."""
from __future__ import annotations

from verispec import Decline
from verispec.seams import Speculator, declared


class LineState:
    """What the drafter knows of one sequence: its tokens and where each line starts."""

    def __init__(self):
        self.tokens: list[int] = []
        self.line_starts: list[int] = [0]  # positions just after a newline (and 0)


class LineCopy(Speculator):
    def __init__(self, spec, *, newline_ids: frozenset[int], **kwargs):
        super().__init__(spec, **kwargs)
        self.newline_ids = newline_ids

    def new_state(self) -> LineState:
        return LineState()

    def commit(self, state: LineState, tokens, hidden_rows, start_pos: int) -> None:
        # tokens that landed at start_pos..; hidden_rows is None (needs_hidden_state=False)
        del state.tokens[start_pos:]
        state.line_starts = [s for s in state.line_starts if s <= start_pos]
        for token in tokens:
            state.tokens.append(int(token))
            if token in self.newline_ids:
                state.line_starts.append(len(state.tokens))

    def propose(self, state: LineState, ctx) -> list[int]:
        if ctx.last_token in ctx.stop_token_ids:  # never draft past a stop
            return []
        if ctx.last_token in self.newline_ids:  # a line begins: nothing of it to match yet
            return []
        seq = state.tokens + [ctx.last_token]  # the pending token ends the current line so far
        start = state.line_starts[-1]
        line = seq[start:]
        for earlier in reversed(state.line_starts[:-1]):  # the most recent matching line wins
            end = earlier + len(line)
            if end < start and seq[earlier:end] == line:
                return self._rest_of_line(seq, end, ctx)
        return []

    def _rest_of_line(self, seq: list[int], begin: int, ctx) -> list[int]:
        draft = []
        for token in seq[begin:begin + ctx.max_draft_tokens]:  # the loop's bound: no ceiling of our own
            draft.append(token)
            if token in self.newline_ids or token in ctx.stop_token_ids:  # a draft ends at a stop
                break
        return draft


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    """SpeculatorSpec factory: a LineCopy over the trunk tokenizer's newline token, or a Decline
    saying why not."""
    tokenizer = declared(trunk, "tokenizer")
    if tokenizer is None:
        return Decline("line-copy needs the trunk's tokenizer to find its newline token")
    newline = tokenizer.encode("\n", add_special=False)
    if len(newline) != 1:
        return Decline(f"this tokenizer spells a newline as {len(newline)} tokens; line-copy needs one")
    return LineCopy(spec, newline_ids=frozenset(newline), max_draft_tokens=max_draft_tokens,
                    min_draft_prob=min_draft_prob)
