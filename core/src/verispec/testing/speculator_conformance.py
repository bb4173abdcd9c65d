"""The speculator conformance suite: `SpeculatorConformance` runs a third-party drafter on the
toy trunk through the engine's scheduler (`conformance.run_greedy`, `run_greedy_requests`).

Subclass it and provide `make_speculator`, a fixture returning a zero-argument factory. Cases:
the stream equals plain greedy; proposals respect the draft length and are silent at a stop
token; one speculator serving requests in turn drafts for each what it drafts alone; requests
beside each other give their plain streams, and a request's drafts do not depend on them.
"""
from __future__ import annotations

import pytest

from verispec.seams import DraftContext
from verispec.testing.conformance import run_greedy, run_greedy_requests
from verispec.testing.toy import ToyTrunk


class SpeculatorConformance:
    """Runs a speculator on the toy trunk; provide `make_speculator` (a zero-arg factory)."""

    #: a prompt with repeats so lookup-style drafters find matches.
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3

    @pytest.fixture
    def toy_trunk(self):
        return ToyTrunk(vocab_size=16, recurrent=True)

    def test_stream_equals_plain_greedy(self, toy_trunk, make_speculator):
        plain = run_greedy(toy_trunk, self.prompt, 64)[0]
        got, _ = run_greedy(toy_trunk, self.prompt, 64, make_speculator())
        assert got == plain

    def _seeded(self, speculator):
        state = speculator.new_state()
        speculator.commit(state, self.prompt, None, 0)
        return state

    def test_proposals_respect_max_draft_tokens(self, make_speculator):
        speculator = make_speculator()
        state = self._seeded(speculator)
        for k in (1, 2, 5):
            draft = speculator.propose(state, DraftContext(last_token=self.prompt[0], pos=len(self.prompt),
                                                           max_draft_tokens=k,
                                                           min_draft_prob=speculator.min_draft_prob))
            assert len(draft) <= k and all(isinstance(t, int) for t in draft)

    def test_silent_at_a_stop_token(self, make_speculator):
        speculator = make_speculator()
        state = self._seeded(speculator)
        ctx = DraftContext(last_token=self.prompt[0], pos=len(self.prompt), max_draft_tokens=4,
                           min_draft_prob=speculator.min_draft_prob, stop_token_ids=frozenset({self.prompt[0]}))
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
        more arrive (prefills beside its decodes, no drafting), the short one leaves, the first
        finishes, and the last drafts alone over what it committed in the batch."""
        prompts = [self.prompt, self.prompt[5:] + self.prompt[:5], self.prompt[3:12]]
        limits = [48, 6, 64]
        plains = [run_greedy(toy_trunk, p, n)[0] for p, n in zip(prompts, limits)]
        runs = run_greedy_requests(toy_trunk, prompts, limits, make_speculator(), submit_at=[0, 3, 3])
        assert [tokens for tokens, _ in runs] == plains
        first, _, last = (ex.stats for _, ex in runs)
        assert first.num_plain_steps > 0 and last.num_plain_steps > 0  # the batched steps happened
        assert last.num_spec_steps + last.num_no_draft_steps > 0  # and the last was asked to draft alone

    def test_a_request_drafts_the_same_whatever_runs_beside_it(self, toy_trunk, make_speculator):
        """A request speculates alone, decodes in a batch beside two short ones, and speculates
        again after they leave: its stream and its draft/accept counts do not depend on which
        requests those were (its state sees only its own sequence; the toy is batch-invariant)."""
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
        assert stats[0].num_plain_steps > 0  # it decoded in the batch
        assert stats[0].num_spec_steps + stats[0].num_no_draft_steps > arrivals[1] - 1  # and drafted after it
