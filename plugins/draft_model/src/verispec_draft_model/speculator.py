"""The `draft-model` speculator: a small model of the same tokenizer drafts for the served one.

Each sequence of the trunk has a sequence in the draft trunk (the drafter), which holds a
suffix of the committed tokens, those from `offset` on. The invariant: the drafter's positions
[0, n) hold committed tokens offset .. offset+n-1. A step, with the pending token x at trunk
position p (`DraftContext`):

    logits = drafter(tokens[offset+n:p] + [x])   # what it has not seen, then x: one forward
    d1 = argmax(logits[-1])                      # kept if its gate passes
    logits = drafter([d1]); d2 = argmax(...)     # one-row greedy steps, K in all

then `keep(num_kept)` cuts the drafter back to the rows the trunk kept (it never holds the last
draft), and `commit` records what landed. After a drafting step the drafter lags by a token or
two, folded into the next step's first forward. Larger lags are fed apart, so that a draft
step's timing (governor rule 12) measures drafting, not a prefill:
`commit` only records tokens (a prompt, a park, a batched interlude), and the next drafting
step's `prepare` (untimed, as a prefill is) feeds what the drafter missed, in chunks, restarting
it on the last `draft_context` tokens when it missed more than that. A request whose steps never
draft (the draft-length policy's K = 0: drafting does not pay here) never runs the drafter.

Argmax over the trunk's ids only (a drafter's padded vocabulary is never proposed). The gate
(--spec-pmin, `verispec.draft_gate`): drafting stops at the first step whose top-1 probability
over the ten largest logits is below it, after a drafted stop token, at the draft length, and
where the drafter's context ends. Greedy drafts: the loop's acceptance keeps the output exact for
any sampler.

Several sequences draft together (`propose_batch`, a batched engine step): one drafter forward
per draft position carries every sequence still drafting. Both models share the process's torch
threads and run one after the other.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from verispec.draft_gate import top1_gate_prob
from verispec.seams import DraftContext, DraftHeadKind, DrafterMismatch, Segment, Speculator

from verispec_draft_model.binding import binding_problem
from verispec_draft_model.hooks import SPEC

#: a lag of at most this many rows is folded into a draft step's first forward; more is fed in `prepare`.
FOLD_ROWS = 4
#: rows per catch-up forward (a prefill chunk).
CATCH_UP_CHUNK = 512
#: the default `draft_context`: committed tokens the drafter reads when it is armed or restarted.
DRAFT_CONTEXT = 1024


class _DraftSequence:
    """One trunk sequence's drafting state: the committed tokens and the drafter's sequence."""

    def __init__(self, seq: int):
        #: the sequence in the draft trunk.
        self.seq = seq
        #: every committed token, by trunk position.
        self.tokens: list[int] = []
        #: the trunk position of the drafter's position 0; None until the first commit.
        self.offset: int | None = None
        #: where the last proposal's pending token sat (p), for `keep`.
        self.base = 0


class DraftModelSpeculator(Speculator):
    """Drafts with a second trunk (see the module docstring). `draft`: the draft Trunk, already
    bound (`binding.binding_problem` said None); `vocab_size`: the trunk's V; `draft_context`:
    committed tokens the drafter reads when armed (>= 1)."""

    def __init__(self, draft, vocab_size: int, spec=SPEC, *, draft_context: int = DRAFT_CONTEXT, **kwargs):
        super().__init__(spec, **kwargs)
        if draft_context < 1:
            raise ValueError(f"draft_context={draft_context}: give at least 1")
        self.draft = draft
        self.vocab_size = vocab_size
        self.draft_context = draft_context
        self._live: set[int] = set()
        self._released: list[int] = []  # appended by finalizers (any thread), emptied on the engine's

    def new_state(self) -> _DraftSequence:
        self._release_dropped()
        state = _DraftSequence(self.draft.new_sequence())
        self._live.add(state.seq)
        weakref.finalize(state, self._released.append, state.seq)  # a dropped state frees its sequence
        return state

    def propose(self, state: _DraftSequence, ctx: DraftContext) -> list[int]:
        return self.propose_batch([state], [ctx])[0]

    def propose_batch(self, states: Sequence[_DraftSequence], ctxs: Sequence[DraftContext]) -> list[list[int]]:
        """Every sequence's draft, one drafter forward per draft position over all that still draft."""
        drafts: list[list[int]] = [[] for _ in states]
        active = []  # (index, state, ctx, k, rows to forward)
        for i, (state, ctx) in enumerate(zip(states, ctxs)):
            if ctx.last_token in ctx.stop_token_ids:
                continue
            if len(state.tokens) != ctx.pos or state.offset is None:
                raise ValueError(f"{len(state.tokens)} tokens committed, but the pending token sits at {ctx.pos}")
            pos = ctx.pos - state.offset  # x's position in the drafter
            # the drafter writes positions up to pos + k - 1 (it never forwards the last draft)
            k = min(ctx.max_draft_tokens, self.draft.max_context_length - pos)
            if k < 1:
                continue
            state.base = pos
            active.append((i, state, ctx, k, [*state.tokens[state.offset + self.draft.seq_len(state.seq):],
                                              ctx.last_token]))
        while active:
            outs = self.draft.forward([Segment(state.seq, rows) for _, state, _, _, rows in active])
            still = []
            for (i, state, ctx, k, _), out in zip(active, outs):
                logits = out.logits[-1, :self.vocab_size]
                if top1_gate_prob(logits) < ctx.min_draft_prob:
                    continue
                token = int(logits.argmax())
                drafts[i].append(token)
                if token not in ctx.stop_token_ids and len(drafts[i]) < k:
                    still.append((i, state, ctx, k, [token]))
            active = still
        return drafts

    def commit(self, state: _DraftSequence, tokens: Sequence[int], hidden_rows, start_pos: int) -> None:
        if start_pos > len(state.tokens):
            raise ValueError(f"tokens from position {start_pos} committed after {len(state.tokens)}: a gap")
        rewrite = start_pos < len(state.tokens)  # the loop never does; a caller may
        del state.tokens[start_pos:]
        state.tokens.extend(int(t) for t in tokens)
        if state.offset is None or start_pos < state.offset:  # armed, or rewritten before its suffix
            self._restart(state)  # read in the next drafting step's prepare
        elif rewrite and self.draft.seq_len(state.seq) > start_pos - state.offset:
            self.draft.truncate(state.seq, start_pos - state.offset)
        # else the drafter's rows past start_pos are the ones `keep` left: the tokens committed now

    def prepare(self, state: _DraftSequence, ctx: DraftContext) -> None:
        if len(state.tokens) - state.offset - self.draft.seq_len(state.seq) > self.draft_context:
            self._restart(state)
        if len(state.tokens) - state.offset - self.draft.seq_len(state.seq) > FOLD_ROWS:
            self._catch_up(state)

    def keep(self, state: _DraftSequence, num_rows: int) -> None:
        length = state.base + num_rows
        if self.draft.seq_len(state.seq) > length:
            self.draft.truncate(state.seq, length)

    def close(self) -> None:
        self._release_dropped()
        for seq in self._live:
            self.draft.release(seq)
        self._live.clear()

    def _restart(self, state: _DraftSequence) -> None:
        """The drafter is to read the last draft_context committed tokens, from its position 0."""
        self.draft.truncate(state.seq, 0)
        state.offset = max(len(state.tokens) - self.draft_context, 0)

    def _catch_up(self, state: _DraftSequence) -> None:
        """Feed the drafter every committed token it has not seen (within its context), in chunks."""
        held = state.offset + self.draft.seq_len(state.seq)
        end = min(len(state.tokens), state.offset + self.draft.max_context_length - 1)
        for start in range(held, end, CATCH_UP_CHUNK):
            chunk = state.tokens[start:min(start + CATCH_UP_CHUNK, end)]
            self.draft.forward([Segment(state.seq, chunk, logits="none")])

    def _release_dropped(self) -> None:
        while self._released:
            seq = self._released.pop()
            if seq in self._live:
                self._live.discard(seq)
                self.draft.release(seq)


def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head) -> Any:
    """SpeculatorSpec factory: None (declined) unless --draft-model loaded a model; raises
    DrafterMismatch naming the first difference when that model cannot draft for this trunk."""
    if draft_head is None or draft_head.draft_head_kind is not DraftHeadKind.MODEL:
        return None
    problem = binding_problem(trunk, draft_head.trunk)
    if problem is not None:
        raise DrafterMismatch(f"--draft-model {draft_head.path}: {problem}")
    return DraftModelSpeculator(draft_head.trunk, trunk.vocab_size, spec, max_draft_tokens=max_draft_tokens,
                                min_draft_prob=min_draft_prob)
