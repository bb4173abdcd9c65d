"""The core speculator suite, and engine streams through the toy trunk whatever the engine-wide index holds."""
import gc
import random

import pytest

from verispec.testing import SpeculatorConformance, ToyTrunk, run_greedy
from verispec_suffix.speculator import SuffixSpeculator

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3


class TestSuffixConformance(SpeculatorConformance):
    @pytest.fixture
    def make_speculator(self):
        return lambda: SuffixSpeculator(max_draft_tokens=8)


class TestSuffixConformanceWithAFullSharedIndex(SpeculatorConformance):
    """The same suite with an engine-wide index full of the prompt's tokens in random orders."""

    @pytest.fixture
    def make_speculator(self):
        def make():
            speculator = SuffixSpeculator(max_draft_tokens=8, min_draft_prob=0.0)
            rng = random.Random(0)
            for _ in range(20):
                speculator.shared.add(rng.sample(self.prompt, len(self.prompt)))
            return speculator
        return make


def unrelated(vocab_size, n=4000, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(200)] for _ in range(n // 200)]


def adversarial(text, vocab_size, copies=6):
    """Matches that lead nowhere: every window of `text` (1..8 tokens) followed by wrong tokens, many times over."""
    docs = []
    for end in range(1, len(text)):
        wrong = [(t + 1 + end % 3) % vocab_size for t in text[end:end + 8]]
        for n in range(1, 9):
            docs.extend([text[max(0, end - n):end] + wrong] * copies)
    return docs


@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("fill", ["unrelated", "adversarial"])
def test_the_stream_is_plain_greedy_whatever_the_shared_index_holds(recurrent, fill):
    trunk = ToyTrunk(vocab_size=16, recurrent=recurrent, seed=3)
    plain, _ = run_greedy(trunk, PROMPT, 64)
    docs = unrelated(16) if fill == "unrelated" else adversarial(PROMPT + plain, 16)
    speculator = SuffixSpeculator(max_draft_tokens=8, min_draft_prob=0.0, shared_tokens=10**6)
    for d in docs:
        speculator.shared.add(d)
    got, ex = run_greedy(trunk, PROMPT, 64, speculator)
    assert got == plain
    assert ex.stats.num_draft_tokens > ex.stats.num_accepted_tokens  # it drafted, and was wrong
    if fill == "adversarial":  # the shared index's drafts won and were rejected most of the time
        assert ex.stats.num_accepted_tokens < ex.stats.num_draft_tokens / 2


def test_a_repeated_request_drafts_from_the_first_ones_output():
    """One speculator, the same prompt twice in turn: the first request's output, folded when its
    state is let go of, is what the second drafts from (its own index holds only the prompt)."""
    trunk = ToyTrunk(vocab_size=64, recurrent=True, seed=5)
    prompt = list(range(40, 60))
    plain, _ = run_greedy(trunk, prompt, 48)
    speculator = SuffixSpeculator(max_draft_tokens=8)
    first_tokens, first = run_greedy(trunk, prompt, 48, speculator)
    first_stats = first.stats
    del first
    gc.collect()  # the execution held the state: the next new_state folds it
    second_tokens, second = run_greedy(trunk, prompt, 48, speculator)
    assert first_tokens == second_tokens == plain
    assert speculator.shared.num_tokens > 40  # the first output (less the pending last token)
    assert second.stats.num_accepted_tokens > first_stats.num_accepted_tokens + 20
