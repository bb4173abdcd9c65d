"""SpeculativeExecution rules beyond the conformance suite: stops, context clipping,
no-draft steps, late arming, sampling under speculation, and the seams no shipped plugin uses."""
import random
import time

import pytest
import torch

from verispec.execution import SpeculativeExecution, resolve_max_draft_tokens
from verispec.governor import SpeculationCostGovernor
from verispec.sampling import Sampler, SamplingParams
from verispec.seams import UnsupportedTap
from verispec.testing import MarkovTrunk, ScriptedSpeculator, ToyTrunk, oracle_speculator, run_greedy

PROMPT = [1, 5, 9, 2, 7, 3, 11, 4]


def start(ex, prompt, sampler, on_token):
    """Prefill and draw the first token as the scheduler does; returns True when on_token said stop."""
    out = ex.trunk.forward([ex.segment(prompt)])[0]
    ex.take_prefill(prompt, out)
    return ex.emit_first(sampler, out.logits[-1], on_token)


def generate(trunk, speculator, *, max_tokens=32, params=SamplingParams(), stop_ids=(),
             governor=None, stop_when=None, clock=time.perf_counter):
    """Run one execution's loop as a solo request of the scheduler does; returns (draws, execution)."""
    ex = SpeculativeExecution(trunk, trunk.new_sequence(), speculator,
                              stop_token_ids=stop_ids, governor=governor, clock=clock)
    sampler = Sampler(params, PROMPT, trunk.vocab_size)
    draws = []

    def on_token(draw):
        draws.append(draw)
        return (len(draws) >= max_tokens or draw.token in stop_ids
                or (stop_when is not None and stop_when(draws)))

    stop = start(ex, PROMPT, sampler, on_token)
    while not stop:
        stop = ex.step(sampler, on_token)
    return draws, ex


@pytest.fixture
def toy():
    return ToyTrunk(vocab_size=32, recurrent=True)


def plain_stream(trunk, n=48):
    return run_greedy(trunk, PROMPT, n)[0]


def test_max_tokens_inside_an_accepted_window(toy):
    plain = plain_stream(toy)
    draws, ex = generate(toy, oracle_speculator(PROMPT + plain, vocab_size=32), max_tokens=5)
    assert [d.token for d in draws] == plain[:5]
    assert ex.seq_len == len(PROMPT) + 4  # the 5th token is pending, never written


def test_stop_token_accepted_mid_window_ends_the_step_there(toy):
    plain = plain_stream(toy)
    stop = plain[3]
    draws, ex = generate(toy, oracle_speculator(PROMPT + plain, vocab_size=32), stop_ids=(stop,))
    tokens = [d.token for d in draws]
    assert tokens == plain[:plain.index(stop) + 1]
    # the stop row and rows past it were rejected: usage counts emitted tokens only
    assert ex.stats.num_emitted_tokens == len(tokens)


def test_a_window_never_starts_at_a_stop_token(toy):
    plain = plain_stream(toy)
    stop = plain[2]
    seen = []

    def script(ctx):
        seen.append(ctx.last_token)
        return list((PROMPT + plain)[ctx.pos + 1:ctx.pos + 1 + ctx.max_draft_tokens])

    # stop ids are passed, but on_token ignores them (like --ignore-eos with a stop id in the vocabulary)
    ex = SpeculativeExecution(toy, toy.new_sequence(), ScriptedSpeculator(script), stop_token_ids=(stop,))
    sampler = Sampler(SamplingParams(), PROMPT, 32)
    out = []
    done = start(ex, PROMPT, sampler, lambda d: out.append(d.token) or len(out) >= 24)
    while not done:
        done = ex.step(sampler, lambda d: out.append(d.token) or len(out) >= 24)
    assert out == plain[:24]
    assert stop not in seen


def test_draft_length_is_clipped_to_the_context():
    for spare in (0, 1, 2, 3):
        trunk = ToyTrunk(vocab_size=32, recurrent=True, max_context_length=len(PROMPT) + 8 + spare)
        plain = run_greedy(trunk, PROMPT, 8 + spare)[0]
        rows = []
        orig = trunk.forward
        trunk.forward = lambda batch: rows.extend(trunk.seq_len(s.seq) + s.tokens.numel() for s in batch) or orig(batch)
        draws, ex = generate(trunk, oracle_speculator(PROMPT + plain, vocab_size=32),
                             stop_when=lambda d: len(PROMPT) + len(d) >= trunk.max_context_length)
        assert [d.token for d in draws] == plain[:len(draws)]
        assert ex.seq_len <= trunk.max_context_length
        assert max(rows) <= trunk.max_context_length  # no verify writes past the context
        assert len(PROMPT) + len(draws) == trunk.max_context_length  # and decoding ran up to it


def test_empty_proposals_still_hand_the_drafter_fresh_hidden_rows(toy):
    """A drafter that proposed nothing for a while gets the hidden row of the latest committed
    position on every step (a tap is a slice of rows the forward computes anyway), never a stale one."""
    segments, seen = [], []
    orig_forward = toy.forward
    toy.forward = lambda batch: segments.extend(batch) or orig_forward(batch)

    def script(ctx):
        seen.append(ctx.hidden_prev)
        return []

    speculator = ScriptedSpeculator(script, needs_hidden_state=True)
    draws, ex = generate(toy, speculator, max_tokens=10)
    toy.forward = orig_forward
    assert [d.token for d in draws] == plain_stream(toy)[:10]
    assert ex.stats.num_no_draft_steps == 9 and ex.stats.num_spec_steps == 0
    assert all(s.hidden for s in segments) and not any(s.verify for s in segments)
    rows = speculator.last_state.hidden_rows  # one per committed position: prompt + 9 decodes
    assert len(rows) == len(PROMPT) + 9
    assert all(torch.equal(h, rows[len(PROMPT) - 1 + i]) for i, h in enumerate(seen))


def test_seed_committed_respects_can_arm_after_prefix_reuse(toy):
    import attrs

    plain = plain_stream(toy)
    speculator = oracle_speculator(PROMPT + plain, vocab_size=32)
    speculator.spec = attrs.evolve(speculator.spec, can_arm_after_prefix_reuse=False)
    ex = SpeculativeExecution(toy, toy.new_sequence(), speculator)
    ex.seed_committed(PROMPT)
    assert ex.draft_limit() == (0, "unarmed")  # plain steps for this sequence
    speculator.spec = attrs.evolve(speculator.spec, can_arm_after_prefix_reuse=True)
    ex = SpeculativeExecution(toy, toy.new_sequence(), speculator)
    toy.forward([ex.segment(PROMPT)])  # the reused prefix the sequence holds
    ex.seed_committed(PROMPT)
    ex.last_token = plain[0]
    assert ex.draft_limit()[0] > 0
    segment = ex.next_segment(3)  # its first draft: the speculator is armed over the prefix then
    assert speculator.last_state.committed == PROMPT
    assert segment.tokens.tolist() == [plain[0], *plain[1:4]]


def test_a_hidden_free_speculator_is_not_called_until_it_drafts(toy):
    """K = 0 is the plain path: no new_state, commit, prepare or propose while nothing drafts;
    the first draft commits everything the sequence holds in one call."""
    plain = plain_stream(toy)
    calls = []

    class Recording(ScriptedSpeculator):
        def new_state(self):
            calls.append("new_state")
            return super().new_state()

        def commit(self, state, tokens, hidden_rows, start_pos):
            calls.append(("commit", start_pos, len(tokens)))
            super().commit(state, tokens, hidden_rows, start_pos)

    speculator = Recording(lambda ctx: list((PROMPT + plain)[ctx.pos + 1:ctx.pos + 1 + ctx.max_draft_tokens]))
    ex = SpeculativeExecution(toy, toy.new_sequence(), speculator)
    sampler, out = Sampler(SamplingParams(), PROMPT, 32), []
    start(ex, PROMPT, sampler, lambda d: out.append(d.token) and False)
    for _ in range(3):  # plain steps, as a parked or budget-limited request takes them
        ex.take(toy.forward([ex.next_segment(0, "budget")])[0], sampler, lambda d: out.append(d.token) and False)
    assert calls == []
    ex.take(toy.forward([ex.next_segment(2)])[0], sampler, lambda d: out.append(d.token) and False)
    assert calls == ["new_state", ("commit", 0, len(PROMPT) + 3)]
    assert out == plain[:len(out)] and ex.stats.plain_steps == {"budget": 3} and ex.stats.num_spec_steps == 1


def test_resolve_max_draft_tokens_narrows_only_the_default():
    class Prefers3:
        spec_preferred_max_draft_tokens = 3
    assert resolve_max_draft_tokens(None, Prefers3()) == 3
    assert resolve_max_draft_tokens(12, Prefers3()) == 12
    assert resolve_max_draft_tokens(None, object()) == 8


def test_parked_governor_means_plain_steps(toy):
    class Parked:
        def should_speculate(self): return False
        def plain_cause(self): return "parked"
        def record_plain_step(self, elapsed_s, num_emitted=1): self.plain = getattr(self, "plain", 0) + 1
        def record_spec_step(self, *a, **k): raise AssertionError("parked: no speculative step")

    governor = Parked()
    draws, ex = generate(toy, oracle_speculator(PROMPT + plain_stream(toy), vocab_size=32), governor=governor,
                         max_tokens=12)
    assert ex.stats.num_spec_steps == 0 and governor.plain == 11
    assert ex.stats.plain_steps == {"parked": 11}
    assert ex._state is None  # parked from the start: the (hidden-free) speculator was never called


# -- sampling under speculation -------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, top_k=8, logprobs=3),
    SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=2),
])
def test_penalties_and_logprobs_are_applied_per_emitted_token_inside_windows(toy, params):
    plain, _ = generate(toy, None, max_tokens=40, params=params)
    reference = PROMPT + [d.token for d in plain]
    spec, ex = generate(toy, oracle_speculator(reference, vocab_size=32, rng=random.Random(1)), max_tokens=40,
                        params=params)
    assert [d.token for d in spec] == [d.token for d in plain]
    assert [d.logprob for d in spec] == [d.logprob for d in plain]
    assert [d.top_logprobs for d in spec] == [d.top_logprobs for d in plain]
    assert ex.stats.num_accepted_tokens > 0
    unpenalised, _ = generate(toy, None, max_tokens=40, params=SamplingParams(temperature=params.temperature,
                                                                               seed=params.seed))
    assert [d.token for d in unpenalised] != [d.token for d in plain]


def _markov_table(vocab=6, seed=0):
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


def _transition_counts(trunk, params, speculator_factory, num_tokens, seed0):
    vocab = trunk.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    streams = []
    per_seq = 2000
    for s in range(num_tokens // per_seq):
        p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed0 + s)
        ex = SpeculativeExecution(trunk, trunk.new_sequence(), speculator_factory())
        sampler = Sampler(p, [0], vocab)
        out = []
        done = start(ex, [0], sampler, lambda d: out.append(d.token) or len(out) >= per_seq)
        while not done:
            done = ex.step(sampler, lambda d: out.append(d.token) or len(out) >= per_seq)
        seq = [0] + out
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
        streams.append(out)
        trunk.release(ex.seq)
    return counts, streams


def _filtered_probs(row, params):
    x = row / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k:
        keep &= x >= torch.topk(x, params.top_k).values[-1]
    p = torch.softmax(torch.where(keep, x, torch.tensor(-float("inf"))), 0)
    if params.top_p < 1.0:
        order = torch.argsort(p, descending=True)
        cum = torch.cumsum(p[order], 0)
        drop = order[(cum - p[order]) >= params.top_p]
        p[drop] = 0
        p = p / p.sum()
    return p


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_k=5, top_p=0.9)])
def test_speculative_sampling_is_distribution_exact(params):
    """50k draws with and without speculation: chi-square against the filtered softmax, and the
    two empirical transition distributions agree; same seed => same stream."""
    from scipy.stats import chi2_contingency, chisquare

    table = _markov_table()
    trunk = MarkovTrunk(table)
    greedy_next = table.argmax(1).tolist()

    def drafter():  # proposes the greedy chain: often right at T=0.3, often wrong at T=1
        return ScriptedSpeculator(lambda ctx: _chain(greedy_next, ctx.last_token, ctx.max_draft_tokens), max_draft_tokens=4)

    n = 50_000
    plain_counts, plain_streams = _transition_counts(trunk, params, lambda: None, n, seed0=1000)
    other_counts, _ = _transition_counts(trunk, params, drafter, n, seed0=5000)
    _, spec_streams = _transition_counts(trunk, params, drafter, 5_000, seed0=1000)
    assert spec_streams == plain_streams[:len(spec_streams)]  # same seed => same stream, token for token
    for a in range(table.shape[0]):
        probs = _filtered_probs(table[a], params)
        support = probs > 0
        for counts in (plain_counts, other_counts):
            row = counts[a]
            assert row[~support].sum() == 0, "a filtered-out token was drawn"
            if row.sum() > 200:
                p = probs[support].double()
                expected = p / p.sum() * row.sum()
                assert chisquare(row[support].double().numpy(), expected.numpy()).pvalue > 1e-4
        pair = torch.stack([plain_counts[a], other_counts[a]])
        pair = pair[:, pair.sum(0) >= 10]  # chi-square needs populated cells
        if pair.sum() > 400 and pair.shape[1] > 1:
            assert chi2_contingency(pair.numpy()).pvalue > 1e-4


def _chain(next_of, token, k):
    out = []
    for _ in range(k):
        token = next_of[token]
        out.append(token)
    return out


# -- seams no shipped plugin uses yet -----------------------------------------------------

def test_drafter_requested_hidden_taps(toy):
    """A speculator's tap_layers reach the trunk per forward; the trunk itself is never changed."""
    assert toy.view().tap_feature_size((0, 1)) == 2 * toy.hidden_size
    speculator = ScriptedSpeculator(lambda ctx: [], needs_hidden_state=True, tap_layers=(0, 1))
    generate(toy, speculator, max_tokens=3)
    assert speculator.last_state.hidden_rows[0].shape == (2 * toy.hidden_size,)
    plain = ScriptedSpeculator(lambda ctx: [], needs_hidden_state=True)
    generate(toy, plain, max_tokens=3)  # another drafter on the same trunk gets final rows
    assert plain.last_state.hidden_rows[0].shape == (toy.hidden_size,)
    with pytest.raises(UnsupportedTap, match="layers 0..1"):
        toy.view().tap_feature_size((5,))
    bad = ScriptedSpeculator(lambda ctx: [1, 2], needs_hidden_state=True, tap_layers=(5,))
    draws, ex = generate(toy, bad, max_tokens=6)  # a drafter the trunk cannot serve is switched off
    assert [d.token for d in draws] == plain_stream(toy)[:6]
    assert "hidden taps" in ex.fault and ex.stats.num_spec_steps == 0


def test_keep_selects_per_row_recurrent_state_without_a_second_forward(toy):
    """A partial acceptance on the recurrent toy costs one forward per step, never a re-forward."""
    plain = plain_stream(toy)
    before = toy.num_forwards
    draws, ex = generate(toy, oracle_speculator(PROMPT + plain, vocab_size=32, rng=random.Random(2)), max_tokens=40)
    assert [d.token for d in draws] == plain[:40]
    assert 0 < ex.stats.num_accepted_tokens < ex.stats.num_draft_tokens
    steps = ex.stats.num_spec_steps + ex.stats.num_no_draft_steps + ex.stats.num_plain_steps
    assert toy.num_forwards - before == 1 + steps  # the prefill, then one forward per step


# -- plugin faults: never the user's loss ---------------------------------------------------

class Boom(RuntimeError):
    pass


def _raises(ctx):
    raise Boom("drafter bug")


def _exits(ctx):
    raise SystemExit(3)


@pytest.mark.parametrize("script, why", [
    (_raises, "propose raised Boom: drafter bug"),
    (_exits, "propose raised SystemExit: 3"),
    (lambda ctx: None, "returned NoneType"),
    (lambda ctx: "abc", "returned str"),
    (lambda ctx: [1.5, 2], "1.5"),
    (lambda ctx: [True], "True"),
    (lambda ctx: [1, 10 ** 9], "1000000000, not a token id in [0, 32)"),
    (lambda ctx: [-1], "-1"),
    (lambda ctx: list(range(ctx.max_draft_tokens + 1)), "ids for a bound of"),
])
def test_a_misbehaving_propose_is_switched_off_and_the_output_stays_plain(toy, script, why, caplog):
    plain = plain_stream(toy)
    good_steps = 2  # it behaves for a while first: the fault lands mid-sequence

    def flaky(ctx):
        flaky.calls += 1
        return (PROMPT + plain)[ctx.pos + 1:ctx.pos + 3] if flaky.calls <= good_steps else script(ctx)
    flaky.calls = 0

    class Speculator(ScriptedSpeculator):  # a real propose, not the window-trimming ScriptedSpeculator one
        def propose(self, state, ctx):
            return self.script(ctx)

    with caplog.at_level("WARNING", logger="verispec"):
        draws, ex = generate(toy, Speculator(flaky), max_tokens=24)
    assert [d.token for d in draws] == plain[:24]
    assert why in ex.fault and ex.stats.num_spec_steps == good_steps
    assert len(caplog.records) == 1 and "'scripted'" in caplog.text and why in caplog.text
    assert ex.stats.num_plain_steps == 24 - 1 - good_steps - ex.stats.num_accepted_tokens - ex.stats.num_no_draft_steps


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_propose_is_parked_at_its_first_step_and_costs_under_1_3x_plain(toy):
    """A perfect drafter whose propose takes 12 plain steps, more than the 8 a full window could
    save: on a fake clock where every forward costs one plain step, the governor parks it at its
    first speculative step and at the first of the re-probe, so 64 tokens cost < 1.3x plain."""
    plain_step_s, draft_s = 1 / 64, 12 / 64
    clock = FakeClock()
    forward = toy.forward
    toy.forward = lambda batch: setattr(clock, "now", clock.now + plain_step_s) or forward(batch)
    plain, _ = generate(toy, None, max_tokens=64, clock=clock)
    plain_s = clock.now

    reasons, losses_at_calls = [], []
    governor = SpeculationCostGovernor(clock=clock, on_slow_draft=reasons.append)
    governor.start_request(64 - 1)
    speculator = oracle_speculator(PROMPT + [d.token for d in plain], vocab_size=32)
    perfect = speculator.script

    def slow(ctx):
        losses_at_calls.append(governor.stats.losses)
        clock.now += draft_s
        return perfect(ctx)
    speculator.script = slow
    clock.now = 0.0
    draws, ex = generate(toy, speculator, max_tokens=64, governor=governor, clock=clock)
    assert [d.token for d in draws] == [d.token for d in plain]
    assert losses_at_calls == [0, 1]  # one call before the first park, one in the re-probe
    assert ex.stats.draft_s == 2 * draft_s and len(reasons) == 1 and "propose took 188 ms" in reasons[0]
    assert clock.now < 1.3 * plain_s


def test_prepare_runs_before_propose_and_counts_in_the_step(toy):
    """A perfect drafter with a slow `prepare` (a catch-up) and an instant propose: rule 12
    (drafting is propose alone) does not name it slow, but the governor's step times include
    the catch-up, so a `prepare` that costs more than it saves loses like any slow step."""
    clock = FakeClock()
    calls = []
    speculator = oracle_speculator(PROMPT + plain_stream(toy), vocab_size=32)

    def prepare(state, ctx):
        calls.append(("prepare", ctx.pos))
        clock.now += 0.5
    perfect = speculator.script

    def script(ctx):
        calls.append(("propose", ctx.pos))
        return perfect(ctx)
    speculator.prepare, speculator.script = prepare, script
    governor = SpeculationCostGovernor(clock=clock, on_slow_draft=lambda reason: calls.append(reason))
    governor.start_request(15)
    _, ex = generate(toy, speculator, max_tokens=16, governor=governor, clock=clock)
    steps = [pos for what, pos in calls if what == "propose"]
    assert steps and calls[:2] == [("prepare", steps[0]), ("propose", steps[0])]
    assert ex.stats.draft_s == 0.0 and all(isinstance(call, tuple) for call in calls)  # not named slow
    assert governor.stats.spec_ms_per_token >= 500 / 9  # 0.5 s of prepare per step, at most 9 tokens a step


@pytest.mark.parametrize("method", ["new_state", "commit", "keep"])
def test_a_speculator_method_that_raises_is_switched_off(toy, method):
    plain = plain_stream(toy)
    speculator = oracle_speculator(PROMPT + plain, vocab_size=32, rng=random.Random(3))
    original = getattr(speculator, method)
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) > (0 if method == "new_state" else 3):
            raise Boom(method)
        return original(*args)

    setattr(speculator, method, broken)
    draws, ex = generate(toy, speculator, max_tokens=30)
    assert [d.token for d in draws] == plain[:30]
    assert ex.fault == f"speculator 'scripted': {method} raised Boom: {method}"


def test_parked_steps_still_commit_hidden_rows_to_a_drafter_that_needs_them(toy):
    """A head parked by the governor must not see a gap when drafting resumes: every committed
    position arrives with its hidden row."""
    class Parked:
        def should_speculate(self): return False
        def plain_cause(self): return "parked"
        def record_plain_step(self, elapsed_s, num_emitted=1): pass
        def record_spec_step(self, *a, **k): raise AssertionError("parked: no speculative step")

    speculator = ScriptedSpeculator(lambda ctx: [], needs_hidden_state=True)
    draws, ex = generate(toy, speculator, max_tokens=8, governor=Parked())
    assert ex.stats.num_plain_steps == 7
    assert len(speculator.last_state.committed) == len(speculator.last_state.hidden_rows) == len(PROMPT) + 7
