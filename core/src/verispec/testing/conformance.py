"""Conformance suites a target or speculator runs against itself.

A model package subclasses `TargetConformance` and provides one fixture, `target`, that
returns its trunk (any cache state; the suite empties it with `spec_rewind_cache(0)`, which
must also reset recurrent state). Optionally override `prompt` (valid token ids) and
`atol` (used only when the target does not declare `spec_batch_invariant`):

    from verispec.testing import TargetConformance

    class TestMyTrunk(TargetConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def target(cls):
            return load_my_tiny_model()

A speculator plugin subclasses `SpeculatorConformance` and provides `make_speculator`, a
fixture returning a zero-argument factory; the suite runs it on the toy trunk.

Cases: (a) an n-row verify equals n one-row decodes; (b) rollback at every accepted count
0..K leaves the next logits equal to a plain run; (c) rewind is exact; (d) an always-wrong
and a perfect drafter both give the plain greedy stream, the perfect one at acceptance 1.0;
(e) 200+ steps with random accept counts do not drift; (f) a stop inside an accepted
window ends the step there and leaves the cache a plain run would hold.
"""
from __future__ import annotations

import random

import pytest
import torch

from verispec.execution import SpeculativeExecution
from verispec.sampling import Sampler, SamplingParams
from verispec.seams import declared
from verispec.testing.toy import ToyTarget, oracle_speculator
from verispec.trunks import LinearSpecTrunk


def run_greedy(target, prompt, max_tokens, speculator=None, *, stop_at=None, draft_window=8):
    """Greedy-decode `max_tokens` tokens from an empty cache; returns (tokens, execution)."""
    target.spec_rewind_cache(0)
    execution = SpeculativeExecution(LinearSpecTrunk(target), speculator, draft_window=draft_window)
    sampler = Sampler(SamplingParams(), prompt, target.vocab_size)
    out: list[int] = []

    def on_token(draw):
        out.append(draw.token)
        return len(out) >= max_tokens or draw.token == stop_at

    stop = execution.start(prompt, sampler, on_token)
    while not stop:
        stop = execution.step(sampler, on_token)
    return out, execution


def _assert_rows_equal(target, actual, expected, atol):
    if declared(target, "spec_batch_invariant"):
        assert torch.equal(actual, expected), f"max |diff| {(actual - expected).abs().max().item():.3g} (declared batch-invariant)"
    else:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def _plain_logits(target, tokens):
    """Logits fp32 [n, V] of each row, fed one token per forward from an empty cache."""
    target.spec_rewind_cache(0)
    return torch.stack([target.forward(torch.tensor([t])) for t in tokens])


class TargetConformance:
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    atol = 1e-4
    max_window = 8
    num_drift_steps = 200

    @pytest.fixture
    def vocab_size(self, target):
        return target.vocab_size

    def _greedy_continuation(self, target, n):
        return run_greedy(target, self.prompt, n)[0]

    def test_verify_rows_equal_one_row_decodes(self, target):
        extra = self._greedy_continuation(target, self.max_window + 1)
        tokens = self.prompt + extra
        expected = _plain_logits(target, tokens)
        for k in range(2, self.max_window + 2):
            target.spec_rewind_cache(0)
            target.forward(torch.tensor(self.prompt))
            got = target.spec_forward(torch.tensor(extra[:k]), hidden=False, all_logits=True).logits
            _assert_rows_equal(target, got, expected[len(self.prompt):len(self.prompt) + k], self.atol)

    def test_plain_prefill_equals_spec_forward_last_row(self, target):
        target.spec_rewind_cache(0)
        plain = target.forward(torch.tensor(self.prompt))
        target.spec_rewind_cache(0)
        spec = target.spec_forward(torch.tensor(self.prompt), hidden=True, all_logits=True)
        _assert_rows_equal(target, spec.logits[-1], plain, self.atol)
        assert spec.logits.dtype == torch.float32 and spec.logits.shape[0] == len(self.prompt)
        assert spec.hidden.shape == (len(self.prompt), target.spec_feature_size)

    def test_rollback_at_every_accepted_count(self, target):
        plain = self._greedy_continuation(target, self.max_window + 2)
        last, drafts = plain[0], plain[1:self.max_window + 1]
        for num_accepted in range(self.max_window + 1):
            kept = [last, *drafts[:num_accepted]]
            wrong = [(t + 1) % 7 + 1 for t in drafts[num_accepted:]]  # rejected rows differ
            target.spec_rewind_cache(0)
            trunk = LinearSpecTrunk(target)
            trunk.prefill(self.prompt, hidden=False)
            rows = kept + wrong
            trunk.verify(rows, hidden=False)
            trunk.rollback(len(self.prompt), rows, len(kept), hidden=False)
            assert trunk.seq_len == len(self.prompt) + len(kept)
            after = trunk.decode(plain[len(kept)], hidden=False).logits[-1]
            reference = _plain_logits(target, self.prompt + kept + [plain[len(kept)]])[-1]
            _assert_rows_equal(target, after, reference, self.atol)

    def test_rewind_is_exact(self, target):
        tail = self._greedy_continuation(target, 6)
        target.spec_rewind_cache(0)
        target.forward(torch.tensor(self.prompt))
        first = target.spec_forward(torch.tensor(tail), hidden=False, all_logits=True).logits
        target.spec_rewind_cache(len(self.prompt))
        assert target.cache_seq_len == len(self.prompt)
        if not declared(target, "spec_has_recurrent_state"):  # recurrent state needs a restore, not a rewind
            again = target.spec_forward(torch.tensor(tail), hidden=False, all_logits=True).logits
            assert torch.equal(first, again)

    def test_perfect_and_wrong_drafters_give_the_plain_stream(self, target, vocab_size):
        n = 24
        plain = run_greedy(target, self.prompt, n)[0]
        reference = self.prompt + plain
        perfect, ex = run_greedy(target, self.prompt, n, oracle_speculator(reference, vocab_size=vocab_size))
        assert perfect == plain
        assert ex.stats.acceptance_rate == 1.0 and ex.stats.num_spec_steps < n // 2
        wrong, ex = run_greedy(target, self.prompt, n, oracle_speculator(reference, correct=0, vocab_size=vocab_size))
        assert wrong == plain
        assert ex.stats.num_accepted_tokens == 0 and ex.stats.num_draft_tokens > 0

    def test_random_accept_counts_do_not_drift(self, target, vocab_size):
        n = self.num_drift_steps
        plain = run_greedy(target, self.prompt, n)[0]
        speculator = oracle_speculator(self.prompt + plain, vocab_size=vocab_size, rng=random.Random(0))
        got, ex = run_greedy(target, self.prompt, n, speculator)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), None)
        assert got == plain, f"first divergence at output token {first_diff}"
        assert 0 < ex.stats.num_accepted_tokens < ex.stats.num_draft_tokens

    def test_stop_inside_accepted_window(self, target, vocab_size):
        plain = run_greedy(target, self.prompt, 16)[0]
        stop_index = 5
        speculator = oracle_speculator(self.prompt + plain, vocab_size=vocab_size)
        got, ex = run_greedy(target, self.prompt, 16, speculator, stop_at=plain[stop_index])
        expected = plain[:plain.index(plain[stop_index]) + 1]
        assert got == expected
        # the stop token is pending, exactly as after a plain run: the cache holds everything before it
        assert ex.trunk.seq_len == len(self.prompt) + len(expected) - 1


class SpeculatorConformance:
    """Runs a speculator on the toy trunk; provide `make_speculator` (a zero-arg factory)."""

    #: a prompt with repeats so lookup-style drafters find matches.
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3

    @pytest.fixture
    def toy_target(self):
        return ToyTarget(vocab_size=16, recurrent=True)

    def test_stream_equals_plain_greedy(self, toy_target, make_speculator):
        plain = run_greedy(toy_target, self.prompt, 64)[0]
        got, _ = run_greedy(toy_target, self.prompt, 64, make_speculator())
        assert got == plain

    def test_proposals_respect_the_window(self, make_speculator):
        from verispec.seams import DraftContext

        speculator = make_speculator()
        speculator.commit(self.prompt, None, 0)
        for window in (1, 2, 5):
            draft = speculator.propose(DraftContext(last_token=self.prompt[0], pos=len(self.prompt),
                                                    draft_window=window, min_draft_prob=speculator.min_draft_prob))
            assert len(draft) <= window and all(isinstance(t, int) for t in draft)

    def test_silent_at_a_stop_token(self, make_speculator):
        from verispec.seams import DraftContext

        speculator = make_speculator()
        speculator.commit(self.prompt, None, 0)
        ctx = DraftContext(last_token=self.prompt[0], pos=len(self.prompt), draft_window=4,
                           min_draft_prob=speculator.min_draft_prob, stop_token_ids=frozenset({self.prompt[0]}))
        assert speculator.propose(ctx) == []

    def test_reset_then_reseed(self, toy_target, make_speculator):
        speculator = make_speculator()
        plain = run_greedy(toy_target, self.prompt, 32)[0]
        run_greedy(toy_target, self.prompt, 32, speculator)
        speculator.reset()
        got, _ = run_greedy(toy_target, self.prompt, 32, speculator)
        assert got == plain
