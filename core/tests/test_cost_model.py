"""CostModel and Acceptance (verispec.cost_model): the plan against brute force, measured costs,
cold calls, upkeep that outweighs the gain, and k = 0 as the plain path."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.cost_model import (
    CALIBRATION_EDGES,
    COLD_PROPOSE_CALLS,
    PROBE_MAX_DRAFTS,
    PLAN_MARGIN,
    OPTIMISTIC_ALPHA,
    PRIOR_ACCEPT_RATE,
    Acceptance,
    Calibration,
    CostModel,
    expected_accepted,
)
from verispec.execution import SpeculativeExecution
from verispec.governor import GovernorState, SpeculationCostGovernor
from verispec.sampling import Sampler, SamplingParams
from verispec.seams import Proposal
from verispec.specs import SpeculatorSpec
from verispec.testing import ScriptedSpeculator, ToyTrunk, oracle_speculator, run_greedy

PROMPT = [1, 5, 9, 2, 7, 3, 11, 4]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def model_with(forward, *, max_draft_tokens=8, propose=None, upkeep_per_row=None):
    """A CostModel whose forward(n) (seconds) is measured for every row count it may use."""
    model = CostModel(max_draft_tokens)
    for n in range(1, 8 * (max_draft_tokens + 1) + 1):
        model.record_forward(n, forward(n))
    for _ in range(COLD_PROPOSE_CALLS):
        model.record_propose(1, 0.05)  # cold (under COLD_SLACK forwards): discarded
    for k, s in (propose or {}).items():
        model.record_propose(k, s)
    if upkeep_per_row is not None:
        model.record_upkeep(10, 10 * upkeep_per_row)
    return model


def score(model, alphas, ks, other=0):
    """What the plan maximises: the value, a plan without drafts weighted by PLAN_MARGIN."""
    value = model.value(alphas, list(ks), other)
    return value if any(ks) else PLAN_MARGIN * value


def brute_force(model, alphas, limits, other=0):
    """The best k vector by exhaustive search (fewest drafts on ties)."""
    best, best_ks = None, None
    for ks in itertools.product(*(range(lim + 1) for lim in limits)):
        value = score(model, alphas, ks, other)
        if best is None or value > best + 1e-12 or (abs(value - best) <= 1e-12 and sum(ks) < sum(best_ks)):
            best, best_ks = value, list(ks)
    return best_ks, best


def test_expected_accepted_is_the_survival_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.0, 8) == 0.0 and expected_accepted(1.0, 4) == 4.0


def test_acceptance_is_the_truncated_geometric_estimate_and_decays_to_the_prior():
    a = Acceptance()
    assert a.alpha == PRIOR_ACCEPT_RATE
    for _ in range(30):
        a.record(4, 4)  # every draft passes: 4 judged, 4 passed
    assert a.alpha > 0.95
    for _ in range(30):
        a.record(4, 1)  # one passes, the second fails: 2 judged, 1 passed
    assert a.alpha == pytest.approx(0.5, abs=0.02)
    for _ in range(30):
        a.record(4, 0)
    low = a.alpha
    assert low < 0.05
    assert a.planning_alpha == a.alpha  # its own evidence plans
    for _ in range(120):
        a.skip()
    assert low < a.alpha == pytest.approx(PRIOR_ACCEPT_RATE, abs=0.01)
    assert a.planning_alpha == a.alpha  # measured once: the (drifted) estimate plans, no optimism
    with pytest.raises(ValueError, match="accepted <= drafted"):
        a.record(2, 3)


def test_a_new_request_plans_optimistically_until_its_own_drafts_are_judged():
    a = Acceptance()
    assert a.planning_alpha == OPTIMISTIC_ALPHA > a.alpha
    a.record(1, 0)  # one judged draft: not yet enough
    assert a.planning_alpha == OPTIMISTIC_ALPHA
    a.record(2, 0)  # the second: its own estimate plans from now on
    assert a.planning_alpha == a.alpha < 0.3


@settings(max_examples=150, deadline=None)
@given(alphas=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=3),
       limits=st.lists(st.integers(0, 4), min_size=3, max_size=3),
       slope=st.floats(0.0, 1.5), other=st.integers(0, 6))
def test_plan_is_the_brute_force_optimum_when_drafting_is_free(alphas, limits, slope, other):
    """With no drafting or upkeep cost, the best B slots are the B most likely to survive, so the
    survival-ordered plan is exact whatever the forward's shape (flat, memory-bound, linear)."""
    limits = limits[:len(alphas)]
    model = model_with(lambda n: 1.0 + slope * (n - 1) + 0.3 * (n > 4) * slope * (n - 4))
    got = model.plan(alphas, limits, other)
    want, best = brute_force(model, alphas, limits, other)
    assert score(model, alphas, got, other) == pytest.approx(best)
    assert all(0 <= k <= lim for k, lim in zip(got, limits))


def test_a_noisy_table_is_read_non_decreasing_and_extrapolated_by_its_mean_slope():
    model = CostModel(8)
    for n, s in {1: 0.016, 4: 0.026, 7: 0.054, 8: 0.046}.items():  # 8 rows measured cheaper than 7: noise
        model.record_forward(n, s)
    assert model.forward_s(8) == pytest.approx(0.054)  # never less than a smaller count's time
    assert model.forward_s(32) == pytest.approx(0.054 + (0.054 - 0.016) / 7 * 24)  # never free past the table


def test_memory_bound_rows_draft_deep_and_compute_bound_rows_shallow():
    flat = model_with(lambda n: 0.02 + 0.0002 * n)  # memory-bound: a row more costs 1 %
    linear = model_with(lambda n: 0.02 * n)  # compute-bound: every row costs a decode
    assert flat.plan([0.8], [8]) == [8]
    assert linear.plan([0.8], [8]) == [0]  # (1 + S(k)) / (k + 1) < 1 for every k
    assert flat.plan([0.0], [8]) == [0]  # nothing ever accepted: plain
    # a batch of four: the flat forward verifies every request's best slots, the linear one none
    assert flat.plan([0.9, 0.9, 0.1, 0.5], [4] * 4)[:2] == [4, 4]
    assert linear.plan([0.9, 0.9, 0.1, 0.5], [4] * 4) == [0, 0, 0, 0]


def test_the_drafters_cost_decides_where_acceptance_alone_would_draft():
    """A draft model costing a third of a trunk decode per draft row: at α = 0.89 one draft still
    pays on a memory-bound trunk, but not when each draft row costs as much as the decode."""
    forward = lambda n: 0.03 + 0.001 * n  # noqa: E731
    cheap = model_with(forward, propose={k: 0.01 * k for k in range(1, 9)})
    dear = model_with(forward, propose={k: 0.031 * k for k in range(1, 9)})
    assert cheap.plan([0.89], [8]) != [0]
    assert dear.plan([0.89], [8]) == [0]
    assert "ms/token plain" in dear.why_plain(0.89, 8) and "draft" in dear.why_plain(0.89, 8)


def test_a_drafter_whose_upkeep_alone_outweighs_its_gain_is_never_armed():
    """Free to propose, perfect (α = 1), but each committed row costs a whole decode to keep up:
    no k pays, in a step alone or in a batch."""
    model = model_with(lambda n: 0.02 + 0.0001 * n, upkeep_per_row=0.021)
    assert model.plan([1.0], [8]) == [0]
    assert model.plan([1.0, 1.0, 1.0], [8, 8, 8]) == [0, 0, 0]
    assert model_with(lambda n: 0.02 + 0.0001 * n, upkeep_per_row=0.001).plan([1.0], [8]) == [8]


def test_cold_propose_calls_are_discarded_but_not_a_stall():
    model = CostModel(4)
    model.record_forward(1, 0.01)
    assert [model.record_propose(2, 0.15) for _ in range(COLD_PROPOSE_CALLS)] == [False] * COLD_PROPOSE_CALLS
    assert model.propose_s(2) == 0.0  # nothing warm measured yet
    assert model.record_propose(2, 0.004)
    assert model.propose_s(2) == pytest.approx(0.004) and model.propose_s(4) == pytest.approx(0.008)
    stalled = CostModel(4)
    stalled.record_forward(1, 0.01)
    assert stalled.record_propose(2, 60.0)  # a first call of a minute is a stall: judged at once
    assert stalled.plan([1.0], [4]) == [0]


def test_adaptive_off_drafts_every_limit():
    model = model_with(lambda n: 0.02 * n)
    model.adaptive = False
    assert model.plan([0.0, 0.9], [3, 0]) == [3, 0]


def test_profile_times_every_verify_width_on_a_scratch_sequence():
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    model = CostModel(5)
    before = trunk.num_forwards
    model.profile(trunk)
    assert set(model.summary()["forward_ms"]) == {*range(1, 7), 12, 24}  # K + 1 = 6, and a batch's 2x and 4x
    assert trunk.num_forwards - before == 1 + 2 * 6 + 2
    model.profile(trunk)  # once
    assert trunk.num_forwards - before == 1 + 2 * 6 + 2
    assert run_greedy(trunk, PROMPT, 12)[0] == run_greedy(ToyTrunk(vocab_size=32, recurrent=True), PROMPT, 12)[0]


def test_a_burst_of_other_load_during_the_profile_is_not_the_trunks_cost():
    """Another process takes the cores while the first pass times 2..4 rows (5x each): each count
    keeps its least time over the interleaved passes, so the profile is the quiet trunk's."""
    clock = FakeClock()
    trunk = ToyTrunk(vocab_size=32, recurrent=False)
    calls = []
    forward = trunk.forward

    def timed(segments):
        rows = sum(len(s.tokens) for s in segments)
        calls.append(rows)
        burst = 5.0 if len(calls) <= 5 and 2 <= rows <= 4 else 1.0  # the warm-up, then pass 1
        clock.now += 0.01 * (1 + 0.5 * (rows - 1)) * burst
        return forward(segments)

    trunk.forward = timed
    model = CostModel(5, clock=clock)
    model.profile(trunk)
    assert calls[1:13] == [*range(1, 7)] * 2  # interleaved passes over 1 .. K + 1
    for n in range(1, 7):
        assert model.forward_s(n) == pytest.approx(0.01 * (1 + 0.5 * (n - 1)))


# -- through the execution, on a fake clock ---------------------------------------------------

def _solo(trunk, speculator, *, clock, cost_model, governor=None, max_tokens=40, forward_s=0.02):
    """One execution's loop alone; every trunk forward costs forward_s on the fake clock."""
    forward = trunk.forward

    def timed(batch):
        clock.now += forward_s
        return forward(batch)
    trunk.forward = timed
    ex = SpeculativeExecution(trunk, trunk.new_sequence(), speculator, governor=governor, cost_model=cost_model,
                              clock=clock)
    sampler, out = Sampler(SamplingParams(), PROMPT, trunk.vocab_size), []
    on_token = lambda d: out.append(d.token) or len(out) >= max_tokens  # noqa: E731
    first = trunk.forward([ex.segment(PROMPT)])[0]
    ex.take_prefill(PROMPT, first)
    done = ex.emit_first(sampler, first.logits[-1], on_token)
    while not done:
        done = ex.step(sampler, on_token)
    trunk.forward = forward
    return out, ex


def test_upkeep_measured_through_the_loop_makes_the_request_plain():
    """A perfect hidden-row drafter whose commit costs more than a decode per row: once its upkeep
    is measured the model plans k = 0 ("budget") for the rest, and the stream is plain."""
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    plain = run_greedy(trunk, PROMPT, 40)[0]
    clock = FakeClock()
    speculator = ScriptedSpeculator(oracle_speculator(PROMPT + plain, vocab_size=32).script, needs_hidden_state=True)
    commit = speculator.commit

    def slow_commit(state, tokens, hidden_rows, start_pos):
        clock.now += 0.05 * len(tokens)  # 2.5 decodes of upkeep per committed row
        commit(state, tokens, hidden_rows, start_pos)
    speculator.commit = slow_commit
    model = CostModel(8)
    out, ex = _solo(trunk, speculator, clock=clock, cost_model=model)
    assert out == plain
    assert ex.stats.plain_steps["budget"] > 0.5 * len(out)
    assert "upkeep" in ex.stats.budget_line


def test_a_cold_first_propose_does_not_park():
    """The first propose takes 10 plain steps (cold), later ones almost nothing: the governor never
    hears of the cold one and does not park; the request speculates."""
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    plain = run_greedy(trunk, PROMPT, 40)[0]
    clock = FakeClock()
    perfect = oracle_speculator(PROMPT + plain, vocab_size=32)
    calls = []

    def script(ctx):
        calls.append(ctx.pos)
        clock.now += 0.2 if len(calls) == 1 else 0.0001
        return perfect.script(ctx)
    speculator = ScriptedSpeculator(script)
    governor = SpeculationCostGovernor(clock=clock)
    governor.start_request(40)
    out, ex = _solo(trunk, speculator, clock=clock, cost_model=CostModel(8), governor=governor)
    assert out == plain
    assert governor.stats.losses == 0 and governor.stats.state is not GovernorState.PARKED
    assert ex.stats.num_spec_steps > 0 and ex.stats.num_accepted_tokens > 0


def test_a_new_request_starts_from_the_drafters_acceptance_on_this_engine():
    model = CostModel(4)
    assert model.drafter_alpha is None and Acceptance(model.drafter_alpha).planning_alpha == OPTIMISTIC_ALPHA
    for _ in range(12):
        model.record_acceptance(2, 0)  # a drafter that is always wrong here
    prior = model.drafter_alpha
    assert prior == 0.0
    fresh = Acceptance(prior)
    assert fresh.planning_alpha == 0.0  # no optimism: earlier requests measured this drafter
    fresh.skip()
    assert fresh.alpha == 0.0


def test_real_steps_rescale_the_profiles_shape():
    """A long real context makes every row dearer than the profile's: a few real steps at 3x the
    profiled time for 8 rows price every row count at 3x, not only 8 (a count never stepped must
    not look cheap next to it)."""
    model = CostModel(5)
    model.profile(ToyTrunk(vocab_size=32, recurrent=False))
    profiled = {n: model.forward_s(n) for n in (1, 4, 8, 24)}
    for _ in range(40):
        model.record_forward(8, 3 * profiled[8])
    for n, s in profiled.items():
        assert model.forward_s(n) == pytest.approx(3 * s, rel=1e-3)


def test_profile_fits_a_short_context():
    """A model loaded with a 10-position context: the profile stops at the rows it can hold."""
    model = CostModel(8)
    model.profile(ToyTrunk(vocab_size=32, recurrent=True, max_context_length=10))
    assert set(model.summary()["forward_ms"]) == set(range(1, 10))


# -- scored drafts (SpeculatorSpec.scores_drafts) -------------------------------------------------


def test_calibration_measures_each_probability_bin_apart():
    """Believed until measured (each bin starts at its middle); drafts scored 0.99 that are always
    rejected bring that bin down and leave the others alone; survivals are running products."""
    cal = Calibration()
    assert cal.alpha(0.99) == pytest.approx((CALIBRATION_EDGES[-1] + 1) / 2)
    before = cal.alpha(0.6)
    for _ in range(40):
        cal.record([0.99, 0.99, 0.99], 0)  # only the first is judged: a rejection
    assert cal.alpha(0.99) < 0.2 and cal.alpha(0.6) == before
    for _ in range(40):
        cal.record([0.6, 0.6], 2)
    assert cal.alpha(0.6) > 0.9
    assert cal.survivals([0.6, 0.99, 0.99]) == pytest.approx(
        [cal.alpha(0.6), cal.alpha(0.6) * cal.alpha(0.99), cal.alpha(0.6) * cal.alpha(0.99) ** 2])
    assert cal.survivals([]) == []
    assert len(cal.survivals([0.6, 0.99, 0.4, 0.4])) == PROBE_MAX_DRAFTS  # the 0.4 bin is unmeasured: probed cheaply
    with pytest.raises(ValueError, match="accepted"):
        cal.record([0.5], 2)


def _scored_brute_force(model, alphas, limits, survivals, other):
    """The best k vector by exhaustive search when drafting is free; survivals[i] replaces α_i^j."""
    def value(ks):
        tokens = len(alphas) + sum(
            (expected_accepted(alphas[i], k) if survivals[i] is None else sum(survivals[i][:k]))
            for i, k in enumerate(ks))
        v = tokens / model.forward_s(len(alphas) + other + sum(ks))
        return v if any(ks) else PLAN_MARGIN * v
    ranges = [range((lim if s is None else min(lim, len(s))) + 1) for lim, s in zip(limits, survivals)]
    return max(value(ks) for ks in itertools.product(*ranges)), value


@settings(max_examples=100, deadline=None)
@given(alphas=st.lists(st.floats(0.0, 0.99), min_size=3, max_size=3),
       limits=st.lists(st.integers(0, 4), min_size=3, max_size=3),
       scored=st.lists(st.one_of(st.none(), st.lists(st.floats(0.0, 1.0), max_size=4)), min_size=3, max_size=3),
       slope=st.floats(0.0, 1.5), other=st.integers(0, 6))
def test_plan_with_scored_proposals_is_the_brute_force_optimum(alphas, limits, scored, slope, other):
    """A request with a scored proposal plans from its own survivals (at most as many slots as it
    proposed), beside requests planned from α: the plan is still the optimum when drafting is free."""
    survivals = [None if p is None else Calibration().survivals(p) for p in scored]
    model = model_with(lambda n: 1.0 + slope * (n - 1))
    got = model.plan(alphas, limits, other, survivals=survivals)
    best, value = _scored_brute_force(model, alphas, limits, survivals, other)
    assert value(got) == pytest.approx(best)
    assert all(0 <= k <= (lim if s is None else min(lim, len(s))) for k, lim, s in zip(got, limits, survivals))


class _ScoringSpeculator(ScriptedSpeculator):
    """A scripted drafter that scores its drafts: script(ctx) -> (ids, probs)."""

    def __init__(self, script, *, as_list=False):
        super().__init__(script, spec=SpeculatorSpec(name="scoring", summary="scored drafts (tests)",
                                                     factory=ScriptedSpeculator, scores_drafts=True))
        self.as_list = as_list
        self.bounds: list[int] = []

    def propose(self, state, ctx):
        self.bounds.append(ctx.max_draft_tokens)
        ids, probs = self.script(ctx)
        ids = ids[:ctx.max_draft_tokens]
        probs = probs[:len(ids)]
        return list(ids) if self.as_list else Proposal(ids, probs)


def _rows_priced(trunk, clock, *, one_row_s=0.02, row_slope=0.5) -> CostModel:
    """Every forward of n rows costs one_row_s · (1 + row_slope · (n - 1)) on the fake clock;
    returns a CostModel (K = 8) that has profiled it, as the engine's does at load."""
    forward = trunk.forward

    def priced(batch):
        clock.now += one_row_s * (1 + row_slope * (sum(len(s.tokens) for s in batch) - 1))
        return forward(batch)
    trunk.forward = priced
    model = CostModel(8, clock=clock)
    model.profile(trunk)
    return model


def test_a_scored_proposal_is_verified_as_far_as_it_pays():
    """Drafts scored 0.99, 0.99, 0.99, then 0.05 (the oracle gets the first three right): the
    drafter is asked at the whole limit, and the plan verifies the three likely ones only, so
    every verified draft is accepted; the stream is plain."""
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    plain = run_greedy(trunk, PROMPT, 40)[0]
    oracle = oracle_speculator(PROMPT + plain, vocab_size=32, correct=3).script
    speculator = _ScoringSpeculator(lambda ctx: (oracle(ctx), [0.99] * 3 + [0.05] * 5))
    clock = FakeClock()
    out, ex = _solo(trunk, speculator, clock=clock, cost_model=_rows_priced(trunk, clock), forward_s=0.0)
    assert out == plain
    assert set(speculator.bounds[:-1]) == {8}  # no probe cap: the proposal itself is weighed
    assert len(ex.stats.num_accepted_tokens_per_pos) == 3  # never a fourth draft verified
    assert ex.stats.num_accepted_tokens == ex.stats.num_draft_tokens > 0


def test_a_drafter_sure_of_wrong_drafts_is_calibrated_down_to_plain():
    """Every draft scored 0.99 and every one wrong: after a few rejections the engine's calibration
    of 0.99 falls and the plan verifies nothing ("budget"); the stream is plain."""
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    plain = run_greedy(trunk, PROMPT, 40)[0]
    wrong = oracle_speculator(PROMPT + plain, vocab_size=32, correct=0).script
    speculator = _ScoringSpeculator(lambda ctx: (wrong(ctx), [0.99] * 8))
    clock = FakeClock()
    model = _rows_priced(trunk, clock)
    out, ex = _solo(trunk, speculator, clock=clock, cost_model=model, forward_s=0.0)
    assert out == plain
    assert ex.stats.num_spec_steps <= 10 and ex.stats.plain_steps["budget"] > 0.6 * len(out)
    assert model.calibration.alpha(0.99) < 0.5
    assert "α=" in ex.stats.budget_line


def test_a_scoring_drafter_that_returns_a_bare_list_is_switched_off():
    trunk = ToyTrunk(vocab_size=32, recurrent=True)
    plain = run_greedy(trunk, PROMPT, 40)[0]
    oracle = oracle_speculator(PROMPT + plain, vocab_size=32).script
    speculator = _ScoringSpeculator(lambda ctx: (oracle(ctx), [0.9] * 8), as_list=True)
    out, ex = _solo(trunk, speculator, clock=FakeClock(), cost_model=CostModel(8))
    assert out == plain
    assert "not a Proposal" in ex.fault and ex.stats.num_spec_steps == 0


def test_a_proposal_holds_one_probability_per_id():
    assert Proposal([3, 4], [0.5, 1.0]).probs == [0.5, 1.0] and Proposal([3, 4], [0.5, 1]) == [3, 4]
    for probs in ([0.5], [0.5, 1.5], [float("nan"), 0.5]):
        with pytest.raises(ValueError, match="one probability in"):
            Proposal([3, 4], probs)
