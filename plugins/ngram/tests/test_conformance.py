"""The core conformance suites with the n-gram speculator (toy trunks)."""
import pytest

from verispec.testing import SpeculatorConformance, ToyTarget, run_greedy
from verispec_ngram.speculator import NGramSpeculator


class TestNGramConformance(SpeculatorConformance):
    @pytest.fixture
    def make_speculator(self):
        return lambda: NGramSpeculator(max_draft_tokens=8)


def test_ngram_accepts_on_a_repetitive_toy_stream():
    """A model that loops (the toy trunk falls into a cycle) is where lookup drafting pays."""
    target = ToyTarget(vocab_size=16, recurrent=False, seed=3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 4
    plain, _ = run_greedy(target, prompt, 96)
    got, ex = run_greedy(target, prompt, 96, NGramSpeculator(max_draft_tokens=8))
    assert got == plain
    assert ex.stats.num_accepted_tokens > 0
    assert ex.stats.num_spec_steps < 96
