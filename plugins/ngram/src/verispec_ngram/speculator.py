"""N-gram lookup drafter: propose what followed the latest earlier occurrence of the last few tokens.

The rule. Let S = committed tokens + [ctx.last_token] (the pending token sits at
L = ctx.pos = len(committed)). For n from `max_order` down to the required order, find
the most recent j < L with S[j-n+1 .. j] == S[L-n+1 .. L]; the first n that has one wins.
The draft copies what followed that occurrence, S[j+1], S[j+2], ..., reading past S's end
from the draft itself (an LZ77-style overlapping copy with period L - j), so a repeat
that runs into the pending token keeps repeating. It stops at
ctx.max_draft_tokens tokens, or right after a stop token (the stop token is included).

Worked example, orders 1..4, pmin 0, K = 3:

    pos  0 1 2 3 4 5 | 6 (pending)
    S    a b c d a b | c
    n=4  [d a b c] occurs nowhere earlier
    n=3  [a b c] ends at j=2  ->  draft S[3], S[4], S[5] = [d, a, b]

Self-overlap, same settings: S = x a a a | a (L=4). n=4 [a a a a]: the only span
ending before 4 is [x a a a], no. n=3 [a a a] ends at j=3 -> S[4] = a (the pending token),
then S[5], S[6] come from the draft itself -> [a, a, a].

The gate (--spec-pmin, ctx.min_draft_prob, clamped to [0, 1]) sets the shortest order accepted:
required = min_order + floor(pmin * (max_order - min_order) + 0.5); with orders 1..4 that
is 1 for pmin < 1/6, 2 below 1/2, 3 below 5/6, else 4. The default orders 1..4 are
llama.cpp's lookup range (LLAMA_NGRAM_MIN/MAX in common/ngram-cache.h).

The index: one dict per order, key = the n-gram's token ids packed 32 bits each into one
int (exact for ids in [0, 2**32)), value = the end position of its latest occurrence. A
commit updates max_order dicts per token and a propose reads at most max_order, so both
cost O(1) per token whatever the history length. A candidate is checked against the
actual tokens before it is used: a key collision (only possible for ids outside that
range) costs a lookup, never a wrong draft.

Each sequence has its own `NGramState` (history and index); the speculator object is shared.

Guards: it never drafts from a history that disagrees with the trunk. A commit at a
position it cannot account for (start_pos != tokens seen) makes that sequence's state
silent, and it ignores commits, until a new state is seeded from position 0 (the loop's
`seed_committed`); a ctx.pos other than the number of tokens seen gets no draft for that step. A pending stop
token gets no draft. With VERISPEC_NGRAM_DEBUG=1 every guard decision goes to stderr.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from verispec.seams import DraftContext, Speculator
from verispec.specs import SpeculatorSpec
from verispec_ngram.hooks import SPEC

if TYPE_CHECKING:
    import torch

_ID_BITS = 32  # bits per token id in a packed n-gram key


class NGramState:
    """One sequence's history and n-gram index (see the module docstring)."""

    def __init__(self, max_order: int):
        self.tokens: list[int] = []  # committed ids, position = index
        # index[n-1]: packed n-gram -> end position of its latest occurrence.
        self.index: list[dict[int, int]] = [{} for _ in range(max_order)]
        # tail[m]: packed key of the m-gram ending at the last committed position (tail[0] = 0).
        self.tail: list[int] = [0]
        self.is_silent = False

    def append(self, t: int) -> None:
        i = len(self.tokens)
        self.tokens.append(t)
        tail = [0]
        # n-grams ending at i, n = 1, 2, ...: zip stops at max_order, or at i + 1 near the start.
        for index, prev_key in zip(self.index, self.tail):
            key = (prev_key << _ID_BITS) | t
            index[key] = i
            tail.append(key)
        self.tail = tail


class NGramSpeculator(Speculator):
    """Weight-free drafter over the whole sequence (prompt and output alike); serves every trunk."""

    def __init__(self, spec: SpeculatorSpec = SPEC, *, max_draft_tokens: int = 8, min_draft_prob: float | None = None,
                 min_order: int = 1, max_order: int = 4):
        if not 1 <= min_order <= max_order:
            raise ValueError(f"n-gram orders min_order={min_order}, max_order={max_order}: "
                             "give 1 <= min_order <= max_order")
        super().__init__(spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
        self.min_order = min_order
        self.max_order = max_order
        self._debug = os.environ.get("VERISPEC_NGRAM_DEBUG") == "1"

    def new_state(self) -> NGramState:
        return NGramState(self.max_order)

    def required_order(self, min_draft_prob: float) -> int:
        """Shortest match length (tokens) the gate accepts: pmin 0 -> min_order, 1 -> max_order."""
        p = min(max(min_draft_prob, 0.0), 1.0)
        return self.min_order + math.floor(p * (self.max_order - self.min_order) + 0.5)

    def commit(self, state: NGramState, tokens: Sequence[int], hidden_rows: "torch.Tensor | None",
               start_pos: int) -> None:
        """Append ids that landed in the sequence at positions start_pos..; hidden_rows is ignored."""
        if state.is_silent:
            self._say(f"commit at {start_pos} ignored: silent until a new state is seeded from 0")
            return
        if start_pos != len(state.tokens):
            state.is_silent = True
            self._say(f"gap: commit at {start_pos} but {len(state.tokens)} tokens seen; silent until reseeded")
            return
        ids = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        for t in ids:
            state.append(int(t))

    def propose(self, state: NGramState, ctx: DraftContext) -> list[int]:
        """Draft ids for positions ctx.pos+1 .., at most ctx.max_draft_tokens.

        The rule is in the module docstring; the gate is ctx.min_draft_prob (the loop fills it
        from --spec-pmin). Empty when nothing matches or a guard refuses (see `_refusal`).
        """
        refusal = self._refusal(state, ctx)
        if refusal is not None:
            self._say(refusal)
            return []
        last = int(ctx.last_token)  # a numpy/torch scalar would overflow the packed key
        j = self._find(state, last, self.required_order(ctx.min_draft_prob))
        if j is None:
            return []
        num_draft = ctx.max_draft_tokens
        return self._copy_after(state, j, last, num_draft, ctx.stop_token_ids)

    def _refusal(self, state: NGramState, ctx: DraftContext) -> str | None:
        """Why this step gets no draft whatever the history holds, or None."""
        if state.is_silent:
            return "silent: a commit gap left the history out of step with the trunk; propose nothing"
        if ctx.pos != len(state.tokens):
            return f"ctx.pos={ctx.pos} but {len(state.tokens)} tokens seen; propose nothing"
        if ctx.last_token in ctx.stop_token_ids:
            return f"last token {ctx.last_token} is a stop token; propose nothing"
        if ctx.max_draft_tokens <= 0:
            return f"max_draft_tokens {ctx.max_draft_tokens}: propose nothing"
        return None

    def _find(self, state: NGramState, last: int, required: int) -> int | None:
        """End position j of the latest occurrence of the longest matching suffix, or None."""
        toks, end = state.tokens, len(state.tokens)  # end = L, where the pending token sits
        for n in range(min(self.max_order, end), required - 1, -1):
            j = state.index[n - 1].get((state.tail[n - 1] << _ID_BITS) | last)
            if j is not None and toks[j] == last and toks[j - n + 1:j] == toks[end - n + 1:end]:
                return j
        return None

    def _copy_after(self, state: NGramState, j: int, last: int, num_draft: int,
                    stop_token_ids: frozenset[int]) -> list[int]:
        """S[j+1], S[j+2], ... where S = committed + [last] + the draft so far (overlapping copy)."""
        draft = state.tokens[j + 1:j + 1 + num_draft]
        if len(draft) < num_draft:  # runs into the pending token: S repeats with period L - j
            period = draft + [last]
            draft = (period * (num_draft // len(period) + 1))[:num_draft]
        stops = stop_token_ids.intersection(draft)
        if stops:  # never continue past a stop token; keep the stop itself
            del draft[min(draft.index(s) for s in stops) + 1:]
        return draft

    def _say(self, message: str) -> None:
        if self._debug:
            print(f"verispec-ngram: {message}", file=sys.stderr)


def create(trunk, *, spec: SpeculatorSpec = SPEC, max_draft_tokens: int, min_draft_prob: float | None,
           draft_head=None) -> NGramSpeculator:
    """SpeculatorSpec factory: the n-gram drafter needs nothing from the trunk, so it serves every one."""
    return NGramSpeculator(spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
