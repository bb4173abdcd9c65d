"""The speculator conformance suite: `SpeculatorConformance` runs a third-party drafter on the
toy trunk through the engine's scheduler (`conformance.run_greedy`, `run_greedy_requests`).

Subclass it and provide `make_speculator`, a fixture returning a zero-argument factory. Cases:
the stream equals plain greedy; it drafts at all (a drafter that never proposes passes every
other case: plain decoding is always right), with hidden rows arriving when it declares
`needs_hidden_state`; proposals respect the draft length and are silent at a stop token; one
speculator serving requests in turn drafts for each what it drafts alone; requests beside each
other give their plain streams, and a request's drafts do not depend on them.

`HeadSpeculatorConformance` is the same suite for a drafter that reads the trunk's hidden rows
(a learned head): over a trunk loaded from a GGUF file, seeded with the trunk's real rows, plus
the check that the final-normed row `ctx.hidden_prev` reads back as the pending token.
"""
from __future__ import annotations

import pytest

from verispec.seams import DraftContext, Segment
from verispec.testing.conformance import run_greedy, run_greedy_requests
from verispec.testing.toy import ToyTrunk


class SpeculatorConformance:
    """Runs a speculator on the toy trunk; provide `make_speculator` (a zero-arg factory)."""

    #: a prompt with repeats so lookup-style drafters find matches.
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3
    #: the opt-out of `test_it_drafts`: why this drafter legitimately never drafts on the suite's
    #: trunk (it keys on a token the toy never emits, it needs a tokenizer the toy lacks...). Set
    #: it and that one test skips, printing the reason; None (the default): it must draft.
    never_drafts_here: str | None = None

    @pytest.fixture
    def toy_trunk(self):
        return ToyTrunk(vocab_size=16, recurrent=True)

    def test_stream_equals_plain_greedy(self, toy_trunk, make_speculator):
        plain = run_greedy(toy_trunk, self.prompt, 64)[0]
        got, _ = run_greedy(toy_trunk, self.prompt, 64, make_speculator())
        assert got == plain

    def test_it_drafts(self, toy_trunk, make_speculator):
        """Over 64 greedy tokens of the prompt it proposes at least one token (every other case
        passes a drafter that never drafts: plain decoding is always right)."""
        if self.never_drafts_here:
            pytest.skip(f"never_drafts_here: {self.never_drafts_here}")
        speculator = make_speculator()
        calls = watch(speculator)
        _, execution = run_greedy(toy_trunk, self.prompt, 64, speculator)
        hidden = "" if speculator.spec.needs_hidden_state else (
            "; note: ctx.hidden_prev and commit's hidden_rows are None unless its SpeculatorSpec declares "
            "needs_hidden_state=True")
        assert execution.stats.num_draft_tokens > 0, (
            f"{speculator.name!r} proposed no token in {len(calls.contexts)} propose calls over 64 tokens on the "
            f"suite's trunk{hidden}. If it legitimately never drafts here, set never_drafts_here = \"why\" on "
            f"{type(self).__name__}")

    def test_hidden_rows_arrive_when_declared(self, toy_trunk, make_speculator):
        """needs_hidden_state: every propose gets ctx.hidden_prev [F] and every commit its rows
        [n, F], F = the width of the taps it names (`tap_layers`; None: the final-normed rows)."""
        speculator = make_speculator()
        if not speculator.spec.needs_hidden_state:
            pytest.skip("it does not declare needs_hidden_state")
        calls = watch(speculator)
        run_greedy(toy_trunk, self.prompt, 32, speculator)
        width = toy_trunk.view().tap_feature_size(speculator.tap_layers)
        assert calls.contexts, f"{speculator.name!r} was never asked to propose"
        for ctx in calls.contexts:
            assert ctx.hidden_prev is not None and tuple(ctx.hidden_prev.shape) == (width,), (
                f"propose at pos {ctx.pos}: hidden_prev {_shape(ctx.hidden_prev)}, expected ({width},)")
            assert ctx.trunk is not None and ctx.seq is not None
        for tokens, rows, start in calls.commits:
            assert rows is not None and tuple(rows.shape) == (len(tokens), width), (
                f"commit at {start} of {len(tokens)} tokens: hidden_rows {_shape(rows)}, expected "
                f"({len(tokens)}, {width})")

    def _seeded(self, speculator, trunk) -> tuple[object, dict]:
        """A state that has seen the prompt, and the DraftContext fields of the step after it
        (here only tokens: a weight-free drafter reads nothing else)."""
        state = speculator.new_state()
        speculator.commit(state, self.prompt, None, 0)
        return state, {"last_token": self.prompt[0], "pos": len(self.prompt)}

    def test_proposals_respect_max_draft_tokens(self, toy_trunk, make_speculator):
        speculator = make_speculator()
        state, fields = self._seeded(speculator, toy_trunk)
        for k in (1, 2, 5):
            draft = speculator.propose(state, DraftContext(**fields, max_draft_tokens=k,
                                                           min_draft_prob=speculator.min_draft_prob))
            assert len(draft) <= k and all(isinstance(t, int) for t in draft)

    def test_silent_at_a_stop_token(self, toy_trunk, make_speculator):
        speculator = make_speculator()
        state, fields = self._seeded(speculator, toy_trunk)
        ctx = DraftContext(**fields, max_draft_tokens=4, min_draft_prob=speculator.min_draft_prob,
                           stop_token_ids=frozenset({fields["last_token"]}))
        assert speculator.propose(state, ctx) == []

    def test_one_speculator_serves_requests_in_turn(self, toy_trunk, make_speculator):
        """Per-sequence state: two requests of one scheduler share one speculator and run alone in
        turn; each gives its own plain stream, and drafts and has accepted what it does alone."""
        prompts = [self.prompt, self.prompt[5:] + self.prompt[:5]]
        plains = [run_greedy(toy_trunk, p, 32)[0] for p in prompts]
        solos = [run_greedy(toy_trunk, p, 32, make_speculator())[1].stats for p in prompts]
        runs = run_greedy_requests(toy_trunk, prompts, 32, make_speculator(), max_running=1)
        assert [tokens for tokens, _ in runs] == plains
        # a state leaking across requests (or kept on the speculator itself) changes the drafts
        assert [ex.stats for _, ex in runs] == solos

    def test_requests_beside_each_other_give_their_plain_streams(self, toy_trunk, make_speculator):
        """One speculator through a batched interlude: the first request speculates alone, two
        more arrive (prefills beside its verify rows), all three draft in shared forwards, the
        short one leaves, the first finishes, and the last drafts alone."""
        prompts = [self.prompt, self.prompt[5:] + self.prompt[:5], self.prompt[3:12]]
        limits = [48, 6, 64]
        plains = [run_greedy(toy_trunk, p, n)[0] for p, n in zip(prompts, limits)]
        runs = run_greedy_requests(toy_trunk, prompts, limits, make_speculator(), submit_at=[0, 3, 3])
        assert [tokens for tokens, _ in runs] == plains
        first, _, last = (ex.stats for _, ex in runs)
        assert first.num_spec_steps + first.num_no_draft_steps > 0
        assert last.num_spec_steps + last.num_no_draft_steps > 0  # every request was asked to draft

    def test_a_request_drafts_the_same_whatever_runs_beside_it(self, toy_trunk, make_speculator):
        """A request speculates alone, then beside two short ones (their rows in its forwards), then
        alone again: its stream and its draft/accept counts do not depend on which requests those
        were (its state sees only its own sequence; the toy is batch-invariant)."""
        limits, arrivals = [64, 6, 10], [0, 3, 3]
        plain = run_greedy(toy_trunk, self.prompt, limits[0])[0]
        stats = []
        for companions in ([self.prompt[5:20], self.prompt[7:30]], [self.prompt[9:40], self.prompt[2:9] * 2]):
            runs = run_greedy_requests(toy_trunk, [self.prompt, *companions], limits, make_speculator(),
                                       submit_at=arrivals)
            assert runs[0][0] == plain
            assert [tokens for tokens, _ in runs[1:]] == [run_greedy(toy_trunk, p, n)[0]
                                                          for p, n in zip(companions, limits[1:])]
            stats.append(runs[0][1].stats)
        assert stats[0] == stats[1]
        assert stats[0].num_spec_steps + stats[0].num_no_draft_steps > arrivals[1] - 1  # it drafted beside them too


class _Calls:
    """What a watched speculator was given: each propose's DraftContext, each commit's
    (tokens, hidden_rows, start_pos)."""

    def __init__(self):
        self.contexts: list[DraftContext] = []
        self.commits: list[tuple] = []


def watch(speculator) -> _Calls:
    """Record what the loop hands `speculator` (its propose and commit, wrapped on the instance)."""
    calls = _Calls()
    propose, commit = speculator.propose, speculator.commit

    def watched_propose(state, ctx):
        calls.contexts.append(ctx)
        return propose(state, ctx)

    def watched_commit(state, tokens, hidden_rows, start_pos):
        calls.commits.append((list(tokens), hidden_rows, start_pos))
        return commit(state, tokens, hidden_rows, start_pos)

    speculator.propose, speculator.commit = watched_propose, watched_commit
    return calls


def _shape(rows) -> str:
    return "None" if rows is None else str(tuple(rows.shape))


class HeadSpeculatorConformance(SpeculatorConformance):
    """The suite for a drafter that reads the trunk's hidden rows (declares needs_hidden_state):
    it runs over a trunk loaded from a GGUF file (a toy GGUF through the toy family's loader,
    `load_toy_gguf`, with a byte-level vocabulary; override `toy_trunk` with your family's tiny
    trunk when your head is bound to its sizes), and the direct propose cases are seeded with the trunk's real rows and a
    context carrying `hidden_prev`, `seq` and the trunk's view, as the loop's are.

    `make_speculator(self, toy_trunk)` builds the head over that trunk."""

    #: the toy GGUF's sizes (its byte-level vocabulary needs at least 103 ids).
    vocab_size = 110
    hidden_size = 32

    @pytest.fixture
    def toy_trunk(self, tmp_path):
        from verispec.testing.toy import load_toy_gguf, write_toy_gguf

        path = write_toy_gguf(tmp_path / "trunk.gguf", vocab_size=self.vocab_size, dim=self.hidden_size)
        return load_toy_gguf(path)

    def _seeded(self, speculator, trunk) -> tuple[object, dict]:
        """Forward the prompt through `trunk` with the taps the speculator names, commit the rows,
        and return the context of the step after it: last_token is the greedy draw of the last
        row, hidden_prev that row's tap."""
        seq = trunk.new_sequence()
        out = trunk.forward([Segment(seq, list(self.prompt), logits="last", hidden=True,
                                     tap_layers=speculator.tap_layers)])[0]
        state = speculator.new_state()
        speculator.commit(state, self.prompt, out.hidden, 0)
        return state, {"last_token": int(out.logits[-1].argmax()), "pos": len(self.prompt),
                       "hidden_prev": out.hidden[-1], "seq": seq, "trunk": trunk.view()}

    def test_hidden_prev_reads_back_as_the_pending_token(self, toy_trunk, make_speculator):
        """With the final-normed tap (tap_layers None), the LM head over ctx.hidden_prev is the
        logits row the pending token was drawn from: under greedy its argmax is ctx.last_token.
        The same one-line check is a head author's first self-test."""
        speculator = make_speculator()
        if speculator.tap_layers is not None:
            pytest.skip(f"it reads the taps {speculator.tap_layers}, not the final-normed rows")
        calls = watch(speculator)
        run_greedy(toy_trunk, self.prompt, 32, speculator)
        assert calls.contexts
        for ctx in calls.contexts:
            assert int(ctx.trunk.logits(ctx.hidden_prev[None]).argmax()) == ctx.last_token
