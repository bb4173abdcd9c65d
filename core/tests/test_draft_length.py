"""DraftLengthPolicy: the per-step draft length rule of its module docstring."""
from __future__ import annotations

import random

import pytest

from verispec.draft_length import (
    PRIOR_ACCEPT_RATE,
    DraftLengthPolicy,
    InvalidDraftLengthRecord,
    expected_tokens,
)

PLAIN_ROW_S = 0.0285  # one int8 row of Gemma 270M on this CPU (docs/reference/baselines.md §5)
#: measured int8 verify cost by rows (docs/reference/baselines.md §5): a knee at ~4 rows
INT8_COST = {2: 0.99, 4: 1.22, 8: 2.28, 16: 4.39, 32: 8.56}


def run(window: DraftLengthPolicy, num_steps: int, accept, step_cost) -> list[int]:
    """Drive the window as the loop does; accept(K) -> accepted drafts, step_cost(n) -> x plain row."""
    window.set_plain_row_s(PLAIN_ROW_S)
    ks = []
    for _ in range(num_steps):
        k = window.next()
        ks.append(k)
        window.record(k, accept(k), k + 1, step_cost(k + 1) * PLAIN_ROW_S)
    return ks


def free_rows(n: int) -> float:
    return 1.0


def int8_rows(n: int) -> float:
    """The measured int8 curve, interpolated: memory-bound to ~4 rows, then linear."""
    if n in INT8_COST:
        return INT8_COST[n]
    lo = max(m for m in (1, *INT8_COST) if m < n)
    hi = min(m for m in INT8_COST if m > n)
    cost_lo = 1.0 if lo == 1 else INT8_COST[lo]
    return cost_lo + (INT8_COST[hi] - cost_lo) * (n - lo) / (hi - lo)


def oracle_best_k(alpha: float, max_draft_tokens: int, cost) -> int:
    """Brute force: the K maximising (sum of alpha^i, i = 0..K) / cost(K + 1), smaller K on ties."""
    values = [(sum(alpha ** i for i in range(k + 1)) / cost(k + 1), -k) for k in range(1, max_draft_tokens + 1)]
    return -max(values)[1]


# E(K) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.999])
@pytest.mark.parametrize("num_drafts", [1, 4, 8])
def test_expected_tokens_is_leviathan_eq_1(alpha, num_drafts):
    assert expected_tokens(alpha, num_drafts) == pytest.approx((1 - alpha ** (num_drafts + 1)) / (1 - alpha))


def test_expected_tokens_at_the_ends():
    assert expected_tokens(0.0, 8) == 1.0  # only the correction
    assert expected_tokens(1.0, 8) == 9.0  # every draft and the bonus


# α ------------------------------------------------------------------------------------------

def test_acceptance_starts_at_the_prior():
    assert DraftLengthPolicy(8).alpha == PRIOR_ACCEPT_RATE


@pytest.mark.parametrize(("num_drafted", "num_accepted", "alpha"), [
    (4, 2, 2 / 3),  # two passes, then one rejection; the fourth draft was never judged
    (4, 4, 1.0),
    (4, 0, 0.0),
    (1, 1, 1.0),
])
def test_acceptance_counts_judged_drafts_only(num_drafted, num_accepted, alpha):
    window = DraftLengthPolicy(8)
    for _ in range(100):  # the prior decays away
        window.record(num_drafted, num_accepted, num_drafted + 1, 0.03)
    assert window.alpha == pytest.approx(alpha, abs=1e-6)


def test_a_step_that_drafted_nothing_is_no_acceptance_evidence():
    window = DraftLengthPolicy(8)
    window.record(0, 0, 1, 0.03)
    assert window.alpha == PRIOR_ACCEPT_RATE


def test_reset_forgets_acceptance_and_keeps_costs():
    window = DraftLengthPolicy(8)
    window.set_plain_row_s(0.02)
    window.record(4, 0, 5, 0.04)
    window.reset()
    assert window.alpha == PRIOR_ACCEPT_RATE
    assert window.row_cost(5) == pytest.approx(2.0)


# cost(n) ------------------------------------------------------------------------------------

def test_cost_is_the_prior_line_until_measured():
    window = DraftLengthPolicy(8, prior_row_cost=0.25)
    assert [window.row_cost(n) for n in (1, 2, 5)] == [1.0, 1.25, 2.0]
    window.record(3, 1, 4, 0.05)  # no plain row time yet: a step time alone is no ratio
    assert window.row_cost(5) == 2.0


def test_cost_interpolates_between_measured_rows_and_extrapolates_with_the_prior():
    window = DraftLengthPolicy(16, prior_row_cost=0.1)
    window.set_plain_row_s(0.02)
    window.record(2, 0, 3, 0.03)  # 1.5x at 3 rows
    window.record(8, 0, 9, 0.06)  # 3.0x at 9 rows
    assert window.row_cost(3) == pytest.approx(1.5)
    assert window.row_cost(2) == pytest.approx(1.25)  # between 1 row (1.0) and 3 rows
    assert window.row_cost(6) == pytest.approx(2.25)  # midway between 3 and 9 rows
    assert window.row_cost(12) == pytest.approx(3.3)  # 9 rows + 3 rows at the prior


def test_cost_is_a_running_mean_per_row_count():
    window = DraftLengthPolicy(8)
    window.set_plain_row_s(0.01)
    window.record(3, 1, 4, 0.02)
    window.record(3, 1, 4, 0.06)
    assert window.row_cost(4) == pytest.approx(3.0)  # 2.0 + 0.25 * (6.0 - 2.0)


# next() -------------------------------------------------------------------------------------

def test_high_acceptance_and_cheap_rows_grow_to_the_ceiling():
    ks = run(DraftLengthPolicy(8), 20, accept=lambda k: k, step_cost=free_rows)
    assert ks[-1] == 8
    assert ks == sorted(ks)  # it only grows


def test_low_acceptance_shrinks_to_one():
    window = DraftLengthPolicy(8)
    run(window, 20, accept=lambda k: k, step_cost=int8_rows)
    ks = run(window, 20, accept=lambda k: 0, step_cost=int8_rows)
    assert ks[0] > 1 and ks[-1] == 1


def test_free_rows_keep_a_long_window_even_at_low_acceptance():
    # a rejected row that costs nothing loses nothing: any chance of a pass is worth drafting
    window = DraftLengthPolicy(8)
    run(window, 8, accept=lambda k: k, step_cost=free_rows)
    assert run(window, 20, accept=lambda k: 0, step_cost=free_rows)[-1] == 8


def test_expensive_rows_give_a_smaller_window_at_the_same_acceptance():
    def accept(k):  # 3 of every 4 judged drafts pass: α = 0.75
        return min(k, 3)
    cheap, costly = DraftLengthPolicy(16), DraftLengthPolicy(16)
    k_cheap = run(cheap, 60, accept, step_cost=free_rows)[-1]
    k_costly = run(costly, 60, accept, step_cost=lambda n: 1.0 + 0.5 * (n - 1))[-1]
    assert k_costly < k_cheap


def test_on_the_measured_int8_curve_the_window_learns_the_knee():
    window = DraftLengthPolicy(16)
    ks = run(window, 40, accept=lambda k: k, step_cost=int8_rows)  # perfect drafts: explores up to 16
    assert ks[-1] == 16
    for _ in range(100):  # then 9 of every 10 judged drafts pass: α = 0.9
        window.record(10, 9, 11, int8_rows(11) * PLAIN_ROW_S)
    assert window.alpha == pytest.approx(0.9, abs=1e-6)
    # what the true curve would choose: 3 drafts, 4 rows (the prior line alone would say 12)
    assert window.next() == oracle_best_k(0.9, 16, int8_rows) == 3
    assert oracle_best_k(0.9, 16, DraftLengthPolicy(16).row_cost) == 12


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 4, 9, 12])
def test_the_window_is_the_argmax_on_its_own_estimates(num_accepted):
    window = DraftLengthPolicy(12, prior_row_cost=0.06, allow_zero=True)
    window.set_plain_row_s(0.02)
    for rows, cost in ((3, 1.1), (6, 1.6), (10, 3.0)):
        window.record(0, 0, rows, cost * 0.02)
    for _ in range(200):  # a of 12 drafts pass: α = a / (a + 1), or 1 when all 12 pass
        window.record(12, num_accepted, 13, 4.0 * 0.02)
    alpha = 1.0 if num_accepted == 12 else num_accepted / (num_accepted + 1)
    assert window.alpha == pytest.approx(alpha, abs=1e-9)
    best = oracle_best_k(window.alpha, 12, window.row_cost)
    pays = expected_tokens(window.alpha, best) / window.row_cost(best + 1) > 1
    assert window.next() == (best if pays else 0)
    assert pays == (num_accepted > 0)


def test_always_within_one_and_max_window_and_deterministic():
    def drive(seed: int) -> list[int]:
        rng = random.Random(seed)
        window = DraftLengthPolicy(6, prior_row_cost=rng.choice([0.0, 0.06, 1.0]), allow_zero=True)
        ks = []
        for _ in range(300):
            if rng.random() < 0.2:
                window.set_plain_row_s(rng.uniform(0.001, 0.1))
            if rng.random() < 0.05:
                window.reset()
            k = window.next()
            assert 0 <= k <= 6
            ks.append(k)
            if k == 0:
                window.skip()
                continue
            num_drafted = rng.randint(0, k)
            window.record(num_drafted, rng.randint(0, num_drafted), num_drafted + 1, rng.uniform(0.0, 0.5))
        return ks
    for seed in range(20):
        assert drive(seed) == drive(seed)


def test_drafting_that_cannot_pay_is_length_zero_once_measured_on_the_requests_own_drafts():
    """A step costing 1.8 plain rows at 2 rows (a draft model whose verify rows are compute-bound):
    at an acceptance of 0.5 one draft expects 1.5 tokens, less than 1.8 plain rows give. A new
    request still drafts on the prior: only its own judged drafts can say K = 0."""
    window = DraftLengthPolicy(8, allow_zero=True)
    assert window.next() >= 1  # nothing measured: the prior line says try
    window.set_plain_row_s(PLAIN_ROW_S)
    window.record(1, 1, 2, 1.8 * PLAIN_ROW_S)
    window.reset()  # a new request: the prior acceptance again, the measured cost kept
    assert window.alpha == PRIOR_ACCEPT_RATE and window.next() >= 1  # the prior alone never says 0
    window.record(2, 1, 3, 2.6 * PLAIN_ROW_S)  # 1 of 2 passes: alpha stays 0.5, 2 judged drafts
    assert window.next() >= 1  # below MIN_OWN_JUDGED
    window.record(1, 0, 2, 1.8 * PLAIN_ROW_S)
    window.record(1, 0, 2, 1.8 * PLAIN_ROW_S)  # now its own evidence says drafting does not pay
    assert window.next() == 0
    zeros = 0
    while window.next() == 0:  # K = 0 steps fade the request's evidence: it drafts again
        window.skip()
        zeros += 1
        assert zeros < 10
    assert zeros >= 1
    for _ in range(30):  # (a text where) every draft passes: α -> 1
        window.record(1, 1, 2, 1.8 * PLAIN_ROW_S)
    assert window.alpha > 0.9 and window.next() >= 1  # 2 tokens per 1.8 rows: drafting pays
    window.reset()
    window.allow_zero = False  # --spec-adaptive off: drafting is forced
    for _ in range(5):
        window.record(1, 0, 2, 1.8 * PLAIN_ROW_S)
    assert window.next() >= 1


def test_length_zero_steps_decay_the_acceptance_toward_the_prior():
    window = DraftLengthPolicy(8)
    window.set_plain_row_s(PLAIN_ROW_S)
    for _ in range(5):
        window.record(4, 0, 5, 3.0 * PLAIN_ROW_S)
    low = window.alpha
    for _ in range(50):
        window.skip()
    assert low < 0.2 and window.alpha == pytest.approx(PRIOR_ACCEPT_RATE, abs=1e-3)


def test_a_window_of_one_is_always_one():
    assert run(DraftLengthPolicy(1), 10, accept=lambda k: k, step_cost=free_rows) == [1] * 10


@pytest.mark.parametrize(("max_draft_tokens", "prior_row_cost"), [(0, 0.06), (8, -0.1)])
def test_bad_construction_is_refused(max_draft_tokens, prior_row_cost):
    with pytest.raises(InvalidDraftLengthRecord, match="DraftLengthPolicy"):
        DraftLengthPolicy(max_draft_tokens, prior_row_cost)


@pytest.mark.parametrize("args", [(2, 3, 3, 0.01), (2, -1, 3, 0.01), (2, 1, 0, 0.01), (2, 1, 3, -0.01)])
def test_bad_records_are_refused(args):
    with pytest.raises(InvalidDraftLengthRecord, match="record"):
        DraftLengthPolicy(8).record(*args)
