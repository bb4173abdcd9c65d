"""The core conformance suites with the n-gram speculator (toy trunks)."""
import pytest

from verispec.testing import SpeculatorConformance, ToyTrunk, run_greedy, run_greedy_requests
from verispec_ngram.speculator import NGramSpeculator

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6] * 4, [2, 7, 1, 8, 2, 8, 1, 8] * 4)


class TestNGramConformance(SpeculatorConformance):
    @pytest.fixture
    def make_speculator(self):
        return lambda: NGramSpeculator(max_draft_tokens=8)


def ends_in_a_cycle(stream, *, max_period=8, span=32):
    return any(stream[-span:] == stream[-span - p:-p] for p in range(1, max_period + 1))


def test_ngram_accepts_on_a_repetitive_toy_stream():
    """A model that loops (the toy trunk falls into a cycle) is where lookup drafting pays."""
    trunk = ToyTrunk(vocab_size=16, recurrent=False, seed=3)
    prompt = PROMPTS[0]
    plain, _ = run_greedy(trunk, prompt, 96)
    assert ends_in_a_cycle(plain)  # the premise: a toy change that breaks it must pick another seed
    got, ex = run_greedy(trunk, prompt, 96, NGramSpeculator(max_draft_tokens=8))
    assert got == plain
    assert ex.stats.num_accepted_tokens > 0
    assert ex.stats.num_spec_steps < 96


def test_one_speculator_drafts_for_requests_in_turn_as_if_each_were_alone():
    """Two requests of one scheduler share one NGramSpeculator and run alone in turn: each stream,
    and each request's draft/accept counts, equal that request run alone (the drafter is
    deterministic given its own history, so any leak between states shows in the counts)."""
    trunk = ToyTrunk(vocab_size=16, recurrent=False, seed=3)
    n = 96
    solo = [run_greedy(trunk, p, n, NGramSpeculator(max_draft_tokens=8)) for p in PROMPTS]
    assert all(ex.stats.num_accepted_tokens > 0 for _, ex in solo)  # there is drafting to compare
    runs = run_greedy_requests(trunk, PROMPTS, n, NGramSpeculator(max_draft_tokens=8), max_running=1)
    for (plain, solo_ex), (tokens, ex) in zip(solo, runs):
        assert tokens == plain
        assert ex.stats == solo_ex.stats
