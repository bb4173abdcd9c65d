"""Conformance suites a trunk or speculator runs against itself.

A model package subclasses `TrunkConformance` and provides one fixture, `trunk`, that
returns its trunk (the suite makes its own sequences). Optionally override `prompt` (valid
token ids; longer than a sliding window, so keeping rows crosses it) and `atol` (used only
when the trunk does not declare `spec_batch_invariant`):

    from verispec.testing import TrunkConformance

    class TestMyTrunk(TrunkConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def trunk(cls):
            return load_my_tiny_model()

A speculator plugin subclasses `SpeculatorConformance` (in `speculator_conformance`) and provides `make_speculator`, a
fixture returning a zero-argument factory; the suite runs it on the toy trunk.

The trunk must hold `required_context_length()` positions per sequence (219 with the
default prompt and num_drift_steps; the suite fails at once, saying so, when it holds fewer).

Trunk cases: (a) an n-row verify equals n one-row decodes; (b) a prefill's last row equals
its rows' logits; (c) `keep` at every row count 0..K, K = 1..16, leaves the next logits
equal to a plain run; (d) truncation is exact (or refused with CannotTruncate), and so is a
fork, which never disturbs its source (a fork at the full length always works); (e) two and
three sequences in one forward — prefill beside decode beside verify — each equal their
solo run; (f) 200 random batched steps over three sequences with random accept counts do
not drift; (g) an always-wrong and a perfect drafter both give the plain greedy stream;
(h) random accept counts through the loop do not drift; (i) a stop inside an accepted
window ends the step there; (j) requests arriving beside a speculating one, and it after they
leave, each give their solo plain stream.

The loops run the engine's path: each greedy stream is a request of a `Scheduler` over the
trunk (`run_greedy`, `run_greedy_requests`), speculating as under `--spec-adaptive off`;
`assert_staggered_streams_plain` runs a mostly wrong drafter through requests arriving apart, and
`assert_second_turn_streams_plain` a drafter over a chat's second turn on a reused prefix.
The speculator suite checks a drafter's stream, its window and stop tokens, one speculator
serving requests in turn (each drafts what it drafts alone), and requests beside each other.
"""
from __future__ import annotations

import random

import pytest
import torch

from verispec.execution import DEFAULT_MAX_DRAFT_TOKENS
from verispec.governor import SpeculationCostGovernor
from verispec.nn.state import CannotTruncate
from verispec.requests import Generation, Request, Speculation
from verispec.sampling import SamplingParams
from verispec.scheduler import DEFAULT_MAX_RUNNING, Scheduler
from verispec.seams import Segment, declared
from verispec.testing.toy import oracle_speculator
from verispec.cost_model import CostModel


class _TokenIds:
    """The text of token ids for a request's stop state (the suites compare ids, never text)."""

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def _speculator_fault(reason: str) -> None:
    raise AssertionError(f"{reason}: a conformant speculator never faults")


def run_greedy_requests(trunk, prompts, max_tokens, speculator=None, *, submit_at=None,
                        max_running=DEFAULT_MAX_RUNNING, stop_at=None, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS):
    """Greedy-decode each prompt as one request of a `Scheduler` over `trunk`, the path the engine
    takes (prefill chunks beside others' verify rows, every decoding request drafting).

    max_tokens: an int, or one per prompt. speculator: shared by every request, speculating under
    `--spec-adaptive off` (every step of an armed request drafts up to its
    bound, max_draft_tokens). submit_at: per prompt, the engine steps run before it is
    submitted (default: all before the first). max_running: requests admitted at once (1: each
    runs alone, one after another; default the engine's). stop_at: a stop token id of every
    request (it is emitted; its finish_reason is "stop").
    Finished sequences stay idle in the trunk, so each execution's `seq_len` stays readable.

    Returns [(tokens, the request's SpeculativeExecution)] in prompt order. Raises the error of a
    failed engine step, and AssertionError when the speculator faults.
    """
    n = len(prompts)
    limits = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    arrivals = [0] * n if submit_at is None else list(submit_at)
    scheduler = Scheduler(trunk, max_running=max_running, max_idle_sequences=n)
    if speculator is not None:
        governor = SpeculationCostGovernor(enabled=False)
        scheduler.set_speculation(Speculation(speculator, governor, CostModel(max_draft_tokens, adaptive=False),
                                              _speculator_fault))
    requests = [Request(Generation(scheduler.step), list(prompt), tokenizer=_TokenIds(), max_tokens=limit,
                        sampling=SamplingParams(), stop=(), stop_ids=() if stop_at is None else (stop_at,),
                        max_context_length=trunk.max_context_length, vocab_size=trunk.vocab_size,
                        time_limit=None)
                for prompt, limit in zip(prompts, limits)]
    waiting = sorted(range(n), key=lambda i: arrivals[i])
    step = 0
    while waiting or scheduler.has_work:
        while waiting and arrivals[waiting[0]] <= step:
            scheduler.submit(requests[waiting.pop(0)])
        scheduler.step()
        step += 1
    for request in requests:
        request.generation.poll()  # raises the error of a step that failed it
    return [(request.generation.result.tokens, request.execution) for request in requests]


def run_greedy(trunk, prompt, max_tokens, speculator=None, *, stop_at=None,
               max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS):
    """Greedy-decode `max_tokens` tokens of one request alone in a new Scheduler over `trunk`
    (see `run_greedy_requests`); returns (tokens, its SpeculativeExecution)."""
    return run_greedy_requests(trunk, [prompt], max_tokens, speculator, stop_at=stop_at,
                               max_draft_tokens=max_draft_tokens)[0]


def assert_staggered_streams_plain(trunk, speculator, prompts, max_tokens, *, submit_at, max_draft_tokens: int,
                                   min_draft_tokens: int = 20) -> list:
    """A drafter that is mostly wrong (a random head) through requests arriving at the steps of
    `submit_at` (a request drafting alone, then beside others in batched forwards, then alone again):
    every stream equals its plain greedy one, more than `min_draft_tokens` drafts were made in all,
    and some were rejected (rollbacks ran). Returns the runs, as run_greedy_requests does."""
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    want = [run_greedy(trunk, list(p), n)[0] for p, n in zip(prompts, limits)]
    runs = run_greedy_requests(trunk, [list(p) for p in prompts], limits, speculator, submit_at=submit_at,
                               max_draft_tokens=max_draft_tokens)
    assert [tokens for tokens, _ in runs] == want
    stats = [ex.stats for _, ex in runs]
    assert sum(s.num_draft_tokens for s in stats) > min_draft_tokens
    assert sum(s.num_accepted_tokens for s in stats) < sum(s.num_draft_tokens for s in stats), "no draft rejected"
    return runs


def assert_second_turn_streams_plain(trunk, speculator, prompt, *, max_draft_tokens: int) -> list[int]:
    """A chat's second turn over a reused prefix: request 1 decodes 10 tokens of `prompt`; request 2,
    submitted after it, is `prompt` + those 10 + three more ids and decodes 24. Asserts that request 2
    took request 1's idle sequence over (the reused prefix: the speculator gets no commit for it),
    streamed the plain greedy tokens, and drafted. Returns request 2's prompt."""
    first = list(prompt)
    second = first + run_greedy(trunk, first, 10)[0] + [4, 9, 2]  # turn 1's answer, then turn 2's text
    want = run_greedy(trunk, second, 24)[0]
    runs = run_greedy_requests(trunk, [first, second], [10, 24], speculator, max_running=1,
                               max_draft_tokens=max_draft_tokens)
    assert runs[1][1].seq == runs[0][1].seq, "turn 2 did not take turn 1's sequence over: no reused prefix"
    assert runs[1][0] == want
    assert runs[1][1].stats.num_draft_tokens > 0, "the speculator never drafted on the second turn"
    return second


def forward_one(trunk, seq, tokens, *, logits="all", hidden=False, tap_layers=None, verify=False):
    """One segment through `trunk.forward`; returns its SegmentOutput."""
    return trunk.forward([Segment(seq, list(tokens), logits=logits, hidden=hidden, tap_layers=tap_layers,
                                   verify=verify)])[0]


def teacher_forced_logits(trunk, tokens):
    """Logits fp32 [n, V] of every row of one forward of `tokens` into a new sequence (released)."""
    seq = trunk.new_sequence()
    logits = forward_one(trunk, seq, tokens).logits
    trunk.release(seq)
    return logits


def assert_rows_within(expected: torch.Tensor, actual: torch.Tensor, bound: float) -> torch.Tensor:
    """Rows of logits fp32 [n, V] that may differ by arithmetic (another world size, another
    reduction order): each row's max |Δlogit| is within `bound`, and an argmax differs only where
    `expected`'s top-2 margin is under twice that row's error (a near-tie). Returns the per-row errors [n]."""
    assert actual.shape == expected.shape, f"{tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (expected - actual).abs().amax(dim=-1)
    assert err.max() <= bound, f"per-row error {err.max():.3g} over the stated bound {bound:g}"
    top2 = expected.topk(2, dim=-1).values
    flips = expected.argmax(-1) != actual.argmax(-1)
    assert not (flips & (top2[:, 0] - top2[:, 1] > 2 * err)).any(), "an argmax flipped outside twice the row's error"
    return err


def plain_logits(trunk, tokens):
    """Logits fp32 [n, V] of each row, fed one token per forward into a new sequence."""
    seq = trunk.new_sequence()
    rows = torch.cat([forward_one(trunk, seq, [t]).logits for t in tokens])
    trunk.release(seq)
    return rows


def _assert_rows_equal(trunk, actual, expected, atol, what=""):
    if declared(trunk, "spec_batch_invariant"):
        assert torch.equal(actual, expected), (
            f"{what} max |diff| {(actual - expected).abs().max().item():.3g} (declared batch-invariant)")
    else:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0, msg=lambda m: f"{what} {m}")


class TrunkConformance:
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    atol = 1e-4
    max_draft_tokens = 8
    #: verify widths K for the keep case (rows 0..K kept for every K in 1..max_keep_rows).
    max_keep_rows = 16
    num_drift_steps = 200

    @classmethod
    def required_context_length(cls) -> int:
        """The positions one sequence needs: the drift case decodes num_drift_steps + 8 tokens
        after its longest prompt (219 with the defaults)."""
        longest = max(len(cls.prompt), len(cls.prompt[::-1]), 2 * len(cls.prompt[1::2]))
        return longest + cls.num_drift_steps + 7

    @pytest.fixture(autouse=True)
    def _context_is_long_enough(self, trunk):
        need = self.required_context_length()
        if trunk.max_context_length < need:
            pytest.fail(f"TrunkConformance needs a trunk with max_context_length >= {need} (the longest "
                        f"prompt + num_drift_steps + 7); this one holds {trunk.max_context_length}: load it "
                        "with a longer context, or lower num_drift_steps / shorten prompt in the subclass")

    @pytest.fixture
    def vocab_size(self, trunk):
        return trunk.vocab_size

    def _greedy_continuation(self, trunk, n):
        return run_greedy(trunk, self.prompt, n)[0]

    def test_verify_rows_equal_one_row_decodes(self, trunk):
        extra = self._greedy_continuation(trunk, self.max_draft_tokens + 1)
        expected = plain_logits(trunk, self.prompt + extra)[len(self.prompt):]
        for k in range(2, self.max_draft_tokens + 2):
            seq = trunk.new_sequence()
            forward_one(trunk, seq, self.prompt, logits="last")
            got = forward_one(trunk, seq, extra[:k], verify=True).logits
            _assert_rows_equal(trunk, got, expected[:k], self.atol, f"{k}-row verify:")
            trunk.release(seq)

    def test_prefill_last_row_and_taps(self, trunk):
        seq = trunk.new_sequence()
        last = forward_one(trunk, seq, self.prompt, logits="last").logits
        every = forward_one(trunk, trunk.new_sequence(), self.prompt, logits="all", hidden=True)
        _assert_rows_equal(trunk, last[0], every.logits[-1], self.atol)
        assert every.logits.dtype == torch.float32 and every.logits.shape == (len(self.prompt), trunk.vocab_size)
        assert every.hidden.shape == (len(self.prompt), trunk.view().tap_feature_size(None))
        assert trunk.seq_len(seq) == len(self.prompt)

    def test_keep_at_every_row_count(self, trunk):
        """For every verify width K and every kept count a in 0..K: the next row equals a plain run's."""
        plain = self._greedy_continuation(trunk, self.max_keep_rows + 1)
        reference = plain_logits(trunk, self.prompt + plain)  # row i: logits after token i
        p = len(self.prompt)
        for k in range(1, self.max_keep_rows + 1):
            for a in range(k + 1):
                rows = plain[:a] + [(t + 1) % trunk.vocab_size for t in plain[a:k]]  # rows past a are wrong
                seq = trunk.new_sequence()
                forward_one(trunk, seq, self.prompt, logits="none")
                forward_one(trunk, seq, rows, logits="none", verify=True)
                trunk.keep(seq, a)
                assert trunk.seq_len(seq) == p + a
                after = forward_one(trunk, seq, [plain[a]]).logits[0]
                _assert_rows_equal(trunk, after, reference[p + a], self.atol, f"K={k}, kept {a}:")
                trunk.release(seq)

    def test_keep_needs_a_verify(self, trunk):
        seq = trunk.new_sequence()
        forward_one(trunk, seq, self.prompt)
        with pytest.raises(ValueError, match="verify"):
            trunk.keep(seq, 1)

    def test_truncate_is_exact_or_refused(self, trunk):
        tail = self._greedy_continuation(trunk, 6)
        seq = trunk.new_sequence()
        forward_one(trunk, seq, self.prompt, logits="none")
        first = forward_one(trunk, seq, tail).logits
        try:
            trunk.truncate(seq, len(self.prompt))
        except CannotTruncate:
            assert trunk.seq_len(seq) == len(self.prompt) + len(tail)  # refused: nothing changed
        else:
            assert trunk.seq_len(seq) == len(self.prompt)
            assert torch.equal(forward_one(trunk, seq, tail).logits, first)
        trunk.truncate(seq, 0)  # always possible: empties the sequence
        assert trunk.seq_len(seq) == 0
        forward_one(trunk, seq, self.prompt, logits="none")
        assert torch.equal(forward_one(trunk, seq, tail).logits, first)

    def test_fork_is_exact_or_refused_and_leaves_the_source(self, trunk):
        tail = self._greedy_continuation(trunk, 6)
        source = trunk.new_sequence()
        forward_one(trunk, source, self.prompt, logits="none")
        expected = forward_one(trunk, source, tail).logits  # the tail's rows after the prompt
        try:
            prefix = trunk.fork(source, len(self.prompt))
        except CannotTruncate:
            pass  # the state kinds cannot be cut back there (recurrent state)
        else:
            assert trunk.seq_len(prefix) == len(self.prompt)
            assert torch.equal(forward_one(trunk, prefix, tail).logits, expected)
            trunk.release(prefix)
        whole = trunk.fork(source, trunk.seq_len(source))
        from_fork = forward_one(trunk, whole, tail[:3]).logits
        from_source = forward_one(trunk, source, tail[:3]).logits  # after the fork wrote its own rows
        assert torch.equal(from_fork, from_source)
        fresh = trunk.new_sequence()
        forward_one(trunk, fresh, self.prompt + tail, logits="none")
        _assert_rows_equal(trunk, from_source, forward_one(trunk, fresh, tail[:3]).logits, self.atol,
                           "the source after a fork:")
        for seq in (source, whole, fresh):
            trunk.release(seq)

    def test_sequences_in_one_forward_equal_their_solo_runs(self, trunk):
        """Prefill of one sequence beside decodes and verifies of others, two and three at a time."""
        prompts = [self.prompt, self.prompt[::-1] + self.prompt[:3], self.prompt[2:] * 2]
        steps = [  # per step, per sequence: (rows to append, verify?) or None (not in this forward)
            [(prompts[0], False), (prompts[1][:5], False), None],
            [(prompts[0][:4], True), (prompts[1][5:], False), (prompts[2], False)],
            [([3], False), None, (prompts[2][:5], True)],
            [(prompts[1][:6], True), ([7], False), ([2], False)],
        ]
        keeps = {(1, 0): 2, (2, 2): 3, (3, 0): 6}  # (step, sequence) -> rows kept after that verify
        together = [trunk.new_sequence() for _ in prompts]
        alone = [trunk.new_sequence() for _ in prompts]
        for step, plan in enumerate(steps):
            batch = [Segment(together[i], rows, logits="all", verify=verify)
                     for i, entry in enumerate(plan) if entry is not None for rows, verify in [entry]]
            outputs = trunk.forward(batch)
            for seg, out in zip(batch, outputs):
                i = together.index(seg.seq)
                solo = forward_one(trunk, alone[i], seg.tokens, verify=seg.verify).logits
                _assert_rows_equal(trunk, out.logits, solo, self.atol, f"step {step}, sequence {i}:")
            for (when, i), kept in keeps.items():
                if when == step:
                    trunk.keep(together[i], kept)
                    trunk.keep(alone[i], kept)
        assert [trunk.seq_len(s) for s in together] == [trunk.seq_len(s) for s in alone]

    def test_random_batched_steps_do_not_drift(self, trunk):
        """Three sequences verify random drafts together, keep random counts; each stream stays
        its plain greedy stream."""
        rng = random.Random(0)
        n = self.num_drift_steps
        prompts = [self.prompt, self.prompt[::-1], self.prompt[1::2] * 2]
        plains = [run_greedy(trunk, p, n + 8)[0] for p in prompts]
        seqs = [trunk.new_sequence() for _ in prompts]
        emitted: list[list[int]] = [[] for _ in prompts]
        firsts = trunk.forward([Segment(s, p) for s, p in zip(seqs, prompts)])
        for out, stream in zip(firsts, emitted):
            stream.append(int(out.logits[-1].argmax()))
        for _ in range(n):
            live = [i for i in range(len(prompts)) if len(emitted[i]) < n]
            if not live:
                break
            batch = []
            for i in live:
                want = plains[i][len(emitted[i]):len(emitted[i]) + rng.randint(0, 6)]
                right = rng.randint(0, len(want))
                draft = want[:right] + [(t + 1) % trunk.vocab_size for t in want[right:]]
                batch.append(Segment(seqs[i], [emitted[i][-1], *draft], logits="all", verify=True))
            for i, seg, out in zip(live, batch, trunk.forward(batch)):
                kept = 0
                for row in range(seg.tokens.numel()):
                    token = int(out.logits[row].argmax())
                    emitted[i].append(token)
                    kept += 1
                    if row + 1 >= seg.tokens.numel() or token != int(seg.tokens[row + 1]):
                        break
                trunk.keep(seqs[i], kept)
        for i, (got, plain) in enumerate(zip(emitted, plains)):
            first_diff = next((j for j, (a, b) in enumerate(zip(got, plain)) if a != b), None)
            assert got[:n] == plain[:len(got[:n])], f"sequence {i}: first divergence at output token {first_diff}"

    def test_perfect_and_wrong_drafters_give_the_plain_stream(self, trunk, vocab_size):
        n = 24
        plain = run_greedy(trunk, self.prompt, n)[0]
        reference = self.prompt + plain
        perfect, ex = run_greedy(trunk, self.prompt, n, oracle_speculator(reference, vocab_size=vocab_size))
        assert perfect == plain
        assert ex.stats.acceptance_rate == 1.0 and ex.stats.num_spec_steps < n // 2
        wrong, ex = run_greedy(trunk, self.prompt, n, oracle_speculator(reference, correct=0, vocab_size=vocab_size))
        assert wrong == plain
        assert ex.stats.num_accepted_tokens == 0 and ex.stats.num_draft_tokens > 0

    def test_random_accept_counts_do_not_drift(self, trunk, vocab_size):
        n = self.num_drift_steps
        plain = run_greedy(trunk, self.prompt, n)[0]
        speculator = oracle_speculator(self.prompt + plain, vocab_size=vocab_size, rng=random.Random(0))
        got, ex = run_greedy(trunk, self.prompt, n, speculator)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), None)
        assert got == plain, f"first divergence at output token {first_diff}"
        assert 0 < ex.stats.num_accepted_tokens < ex.stats.num_draft_tokens

    def test_stop_inside_accepted_window(self, trunk, vocab_size):
        plain = run_greedy(trunk, self.prompt, 16)[0]
        stop_index = 5
        speculator = oracle_speculator(self.prompt + plain, vocab_size=vocab_size)
        got, ex = run_greedy(trunk, self.prompt, 16, speculator, stop_at=plain[stop_index])
        expected = plain[:plain.index(plain[stop_index]) + 1]
        assert got == expected
        # the stop token is pending, exactly as after a plain run: the sequence holds everything before it
        assert ex.seq_len == len(self.prompt) + len(expected) - 1

    def test_requests_beside_a_speculating_one_give_their_plain_streams(self, trunk, vocab_size):
        """One scheduler: a request speculates alone, two more arrive (their prefills beside its
        verify rows), draft beside it, leave; every stream is its solo plain stream."""
        prompts = [self.prompt, self.prompt[::-1], self.prompt[1::2] * 2]
        limits = [40, 8, 12]
        plains = [run_greedy(trunk, p, n)[0] for p, n in zip(prompts, limits)]
        speculator = oracle_speculator(self.prompt + plains[0], vocab_size=vocab_size, rng=random.Random(1))
        arrivals = [0, 3, 4]  # step 0 prefills the first; steps 1 and 2 speculate
        runs = run_greedy_requests(trunk, prompts, limits, speculator, submit_at=arrivals)
        for i, ((got, _), plain) in enumerate(zip(runs, plains)):
            first_diff = next((j for j, (a, b) in enumerate(zip(got, plain)) if a != b), None)
            assert got == plain, f"request {i}: first divergence at output token {first_diff}"
        stats = runs[0][1].stats
        assert stats.num_spec_steps > arrivals[1] - 1  # it speculated before, beside and after the others
        assert all(ex.stats.num_spec_steps > 0 for _, ex in runs[1:])  # and they drafted beside it
