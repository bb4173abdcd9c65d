"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft from this sequence and from earlier requests.

Two `SuffixIndex`es (see `verispec_suffix.index`) serve each step: the sequence's own, over its
prompt and output, and one engine-wide (`RecentDocuments`) over the outputs of finished
sequences (their prompts too with index_prompts), within a token budget, oldest first out.

The rule. Let S = committed tokens + [ctx.last_token], K = ctx.max_draft_tokens. In each index,
each suffix w of S that occurs there (in the sequence's own index every occurrence ends before the
pending token, so it is an earlier one), at most max(1, max_depth - K) tokens long so that K tokens
fit under it, gives a draft: the likeliest continuation of w (`SuffixIndex.continuation`), capped
at floor(max_spec_factor × |w|) tokens (α × match length: a short match is weak evidence) and at
K, and cut before the first token whose estimated probability is under ctx.min_draft_prob
(--spec-pmin). Its score is the sum of those probabilities (the expected accepted tokens). The
index's candidate is the best-scoring draft, the longer w on a tie (ArcticInference tries every
match length the same way: the longest match can run into the end of its text, e.g. in a loop). The
candidate with the higher score is drafted, the sequence's own on a tie. A draft ends right after a
stop token (the stop is drafted); a pending stop token gets no draft.

The draft is scored (a `Proposal`, SpeculatorSpec.scores_drafts): token j's probability given the
drafts before it is its count over its parent's along the matched path, times |w| / (|w| + 1) for
the match's evidence (a match of one token is a coin toss; of 16, 0.94). The engine calibrates
these numbers against what it accepts and verifies only the prefix that pays, so a repeated
answer is drafted in full at once while a weak match in a new request costs nothing.

Cost per step: the longest match is one link walk from a cursor kept along the sequence; the
shorter suffixes are its links, longest first; one with as many occurrences as the last one tried
is skipped (the same occurrences: the same continuation under a lower cap), and the walk stops once
floor(α × |w|) cannot beat the best score so far: O(|w| × K) node visits at worst, usually O(K).

Worked example, max_depth 24, α 1, pmin 0.1, K = 8, engine-wide index empty:

    S = a b c a b d a b | c (pending)
    w = [a b c] occurs once (positions 0..2), |w| <= 24 - 8: cap floor(1 × 3) = 3
    a: 1/1, then [a b c a] → b: 1/1, then → d: 1/1   → draft [a, b, d], score 3
    (shorter w: cap <= 2 cannot beat 3)

How the engine-wide index learns. A state is one sequence (the loop makes one per request); when
the loop lets go of it (the request finished, or its state was replaced), a weakref finalizer
queues its tokens, and the next `new_state` or `prepare` folds them in (never inside a finalizer,
which may run at any allocation; never in `propose`, which the governor times as drafting).
`finish(state)` folds one at once. The first commit a state sees is taken as its prompt (the loop
seeds a late-armed state with everything the sequence holds, so a few tokens decoded before arming
count as prompt).

Guards, as verispec-ngram's: a commit at a position it cannot account for makes the state silent
until a new one is seeded; a ctx.pos other than the tokens seen gets no draft for that step.
"""
from __future__ import annotations

import math
import os
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from verispec.seams import DraftContext, Proposal, Speculator
from verispec.specs import SpeculatorSpec
from verispec_suffix.hooks import SPEC
from verispec_suffix.index import Node, RecentDocuments, SuffixIndex

if TYPE_CHECKING:
    import torch

#: longest string indexed (ArcticInference's default tree depth): bounds match + draft length.
DEFAULT_MAX_DEPTH = 24
#: the engine-wide index's budget in tokens (VERISPEC_SUFFIX_SHARED_TOKENS; 0 = off).
DEFAULT_SHARED_TOKENS = 16384


class Document:
    """A sequence's tokens as the engine-wide index will take them: all of them, and the prompt's length."""

    __slots__ = ("tokens", "prompt_len")

    def __init__(self):
        self.tokens: list[int] = []
        self.prompt_len: int | None = None  # the first commit's length

    def output(self) -> list[int]:
        return self.tokens[self.prompt_len or 0:]


class SuffixState:
    """One sequence: its tokens, its own index and tail, and its cursor into the engine-wide index."""

    def __init__(self, max_depth: int):
        self.document = Document()
        self.index = SuffixIndex(max_depth)
        self.tail: Node = self.index.root  # the last min(len, max_depth) committed tokens
        self.shared_cursor: Node | None = None  # longest suffix of the committed tokens in the shared index
        self.shared_version = -1  # the shared index's version the cursor was found in
        self.is_silent = False
        self.finalizer: weakref.finalize | None = None


class SuffixSpeculator(Speculator):
    """Weight-free drafter over this sequence and earlier ones (module docstring); serves every trunk."""

    def __init__(self, spec: SpeculatorSpec = SPEC, *, max_draft_tokens: int = 8, min_draft_prob: float | None = None,
                 max_depth: int = DEFAULT_MAX_DEPTH, max_spec_factor: float = 1.0,
                 shared_tokens: int = DEFAULT_SHARED_TOKENS, index_prompts: bool = False):
        if max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor={max_spec_factor}: give > 0")
        super().__init__(spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.index_prompts = index_prompts
        self.shared = RecentDocuments(max_depth, shared_tokens)
        self._finished: deque[Document] = deque()  # appended by finalizers, folded by new_state / prepare

    def new_state(self) -> SuffixState:
        self.fold_finished()
        state = SuffixState(self.max_depth)
        state.finalizer = weakref.finalize(state, self._finished.append, state.document)
        state.finalizer.atexit = False
        return state

    def finish(self, state: SuffixState) -> None:
        """The sequence is over: fold its tokens into the engine-wide index now (once; a later drop adds nothing)."""
        state.finalizer()
        self.fold_finished()

    def fold_finished(self) -> None:
        """Index the documents of the states let go of since the last call."""
        while self._finished:
            document = self._finished.popleft()
            self.shared.add(document.tokens if self.index_prompts else document.output())

    def prepare(self, state: SuffixState, ctx: DraftContext) -> None:
        """Untimed catch-up before `propose`: fold finished sequences, find the shared cursor again if stale."""
        self.fold_finished()
        if self.shared.num_tokens:
            self._shared_cursor(state)

    def commit(self, state: SuffixState, tokens: Sequence[int], hidden_rows: "torch.Tensor | None",
               start_pos: int) -> None:
        """Append ids that landed in the sequence at positions start_pos..; hidden_rows is ignored."""
        document = state.document
        if state.is_silent:
            return
        if start_pos != len(document.tokens):
            state.is_silent = True
            return
        ids = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
        if document.prompt_len is None:
            document.prompt_len = len(ids)
        shared = self.shared.index
        follow = state.shared_version == shared.version  # else prepare or propose finds it again
        for t in ids:
            document.tokens.append(t)
            state.tail = state.index.extend(state.tail, t)
            if follow:
                state.shared_cursor = shared.advance(state.shared_cursor, t)

    def propose(self, state: SuffixState, ctx: DraftContext) -> Proposal:
        """Draft ids for positions ctx.pos+1 .., at most ctx.max_draft_tokens, each with its
        probability given the drafts before it (the rule: module docstring)."""
        if (state.is_silent or ctx.pos != len(state.document.tokens) or ctx.last_token in ctx.stop_token_ids
                or ctx.max_draft_tokens <= 0):
            return Proposal([], [])
        last = int(ctx.last_token)
        best = self.candidate(state.index, state.tail, last, ctx.max_draft_tokens, ctx.min_draft_prob)
        if self.shared.num_tokens:
            shared = self.candidate(self.shared.index, self._shared_cursor(state), last,
                                    ctx.max_draft_tokens, ctx.min_draft_prob)
            if shared[2] > best[2]:
                best = shared
        draft, path_probs, _, depth = best
        stops = ctx.stop_token_ids.intersection(draft)
        if stops:  # never continue past a stop token; keep the stop itself
            del draft[min(draft.index(s) for s in stops) + 1:]
        evidence = depth / (depth + 1)
        conditional = [p / q for p, q in zip(path_probs, [1.0, *path_probs])]
        return Proposal(draft, [evidence * p for p in conditional[:len(draft)]])

    def candidate(self, index: SuffixIndex, cursor: Node, last: int, max_tokens: int,
                  min_prob: float) -> tuple[list[int], list[float], float, int]:
        """One index's draft after cursor·last: its ids, their path probabilities, its score (0 when
        nothing matches) and the matched suffix's length |w|."""
        node = index.match(cursor, last)
        room = max(1, index.max_depth - max_tokens)  # so that max_tokens fit under max_depth
        best, best_probs, best_score, best_depth, tried_count = [], [], 0.0, 0, 0
        while node is not None and node.depth > 0:  # the matched suffix, then ever shorter ones
            # As many occurrences as the longer suffix tried last: the same occurrences, so the same
            # continuation under a lower cap; it cannot win.
            if node.depth <= room and node.count != tried_count:
                cap = min(max_tokens, math.floor(self.max_spec_factor * node.depth + 1e-9))
                if cap <= best_score:  # a shorter match drafts no more than cap tokens: none can win
                    break
                tokens, probs = index.continuation(node, cap, min_prob)
                if sum(probs) > best_score:
                    best, best_probs, best_score, best_depth = tokens, probs, sum(probs), node.depth
                tried_count = node.count
            node = node.link
        return best, best_probs, best_score, best_depth

    def _shared_cursor(self, state: SuffixState) -> Node:
        """The longest suffix of the committed tokens in the shared index, found again after it changed."""
        shared = self.shared.index
        if state.shared_version != shared.version:
            cursor = shared.root
            for t in state.document.tokens[-self.max_depth:]:
                cursor = shared.advance(cursor, t)
            state.shared_cursor, state.shared_version = cursor, shared.version
        return state.shared_cursor

    def close(self) -> None:
        self._finished.clear()
        self.shared = RecentDocuments(self.max_depth, 0)


def create(trunk, *, spec: SpeculatorSpec = SPEC, max_draft_tokens: int, min_draft_prob: float | None,
           draft_head=None) -> SuffixSpeculator:
    """SpeculatorSpec factory: needs nothing from the trunk. VERISPEC_SUFFIX_SHARED_TOKENS sets the
    engine-wide index's budget (0 = off); VERISPEC_SUFFIX_PROMPTS=1 indexes finished prompts too."""
    return SuffixSpeculator(spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob,
                            shared_tokens=int(os.environ.get("VERISPEC_SUFFIX_SHARED_TOKENS", DEFAULT_SHARED_TOKENS)),
                            index_prompts=os.environ.get("VERISPEC_SUFFIX_PROMPTS") == "1")
