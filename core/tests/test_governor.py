"""SpeculationCostGovernor: one test per rule of its module docstring, on a fake clock.

Times are dyadic fractions of a second (1/64 s = 15.625 ms), so clock differences are exact.
"""
from __future__ import annotations

import pytest

from verispec.governor import (
    BOOTSTRAP_PLAIN_STEPS,
    MAX_ZERO_ACCEPT_STEPS,
    MAX_DRAFT_STEPS_PER_TOKEN,
    PARK_TOKENS,
    PROBE_STEPS,
    REFRESH_EVERY_STEPS,
    REPROBE_STEPS,
    GovernorState,
    InvalidStepRecord,
    SpeculationCostGovernor,
)

PLAIN_S = 1 / 64  # one plain decode step, one token: 15.625 ms/token
#: speculative steps as (elapsed_s, num_emitted, num_accepted, num_drafted)
FAST = (1 / 32, 3, 2, 4)  # 10.4 ms/token: wins
SLOW = (1 / 16, 2, 1, 4)  # 31.25 ms/token: loses, but accepts something
NOTHING = (1 / 128, 1, 0, 0)  # drafted nothing: 7.8 ms/token, one token, nothing accepted
MARGINAL = (15 / 512, 2, 1, 4)  # 14.6 ms/token: wins by a little


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Loop:
    """The decode loop as the governor sees it: ask, time the step with gov.clock, report."""

    def __init__(self, gov: SpeculationCostGovernor, plain_s: float = PLAIN_S):
        self.gov, self.plain_s = gov, plain_s

    def step(self, spec=FAST, plain_emitted: int = 1, draft_s: float = 0.0) -> bool:
        """One step; `spec` is what a speculative step would report, `draft_s` the part of its
        elapsed_s spent drafting. Returns whether it speculated."""
        speculate = self.gov.should_speculate()
        start = self.gov.clock()
        if speculate:
            elapsed_s, num_emitted, num_accepted, num_drafted = spec
            self.gov.clock.now += elapsed_s
            self.gov.record_spec_step(self.gov.clock() - start, num_emitted, num_accepted, num_drafted,
                                      draft_s)
        else:
            self.gov.clock.now += self.plain_s
            self.gov.record_plain_step(self.gov.clock() - start, plain_emitted)
        return speculate

    def run(self, num_steps: int, spec=FAST) -> list[bool]:
        return [self.step(spec) for _ in range(num_steps)]

    def plain_tokens_until_speculating(self, spec=FAST, limit: int = 10_000) -> int:
        """Plain tokens emitted before should_speculate() turns True."""
        num_tokens = 0
        while not self.gov.should_speculate():
            self.step(spec)
            num_tokens += 1
            if num_tokens > limit:
                raise AssertionError("never speculated again")
        return num_tokens


def bootstrapped(enabled: bool = True) -> tuple[SpeculationCostGovernor, Loop]:
    """A governor past its bootstrap, at the start of its first probe, inside a long request."""
    gov = SpeculationCostGovernor(clock=FakeClock(), enabled=enabled)
    gov.start_request(10_000)
    loop = Loop(gov)
    if enabled:
        loop.run(BOOTSTRAP_PLAIN_STEPS + 1)
        assert gov.stats.state is GovernorState.PROBE
    return gov, loop


def lose_probe(loop: Loop) -> None:
    while loop.gov.stats.state is GovernorState.PROBE:
        loop.step(SLOW)


def lose_watch(loop: Loop) -> None:
    while loop.gov.stats.state is GovernorState.WATCH:
        loop.step(SLOW)


def tokens_until_unparked(loop: Loop) -> int:
    """Plain tokens until the park is used up (whether or not the request is armed)."""
    num_tokens = 0
    while loop.gov.stats.state is GovernorState.PARKED:
        loop.step()
        num_tokens += 1
    return num_tokens


def test_clock_is_injected_and_read_by_the_loop():
    clock = FakeClock()
    gov = SpeculationCostGovernor(clock=clock)
    assert gov.clock is clock


# rule 9 -----------------------------------------------------------------------------------

def test_bootstrap_measures_plain_first_then_probes():
    gov = SpeculationCostGovernor(clock=FakeClock())
    gov.start_request(100)
    assert gov.stats.state is GovernorState.BOOTSTRAP
    decisions = Loop(gov).run(BOOTSTRAP_PLAIN_STEPS + 2)
    # the first plain step follows prefill and is discarded, then BOOTSTRAP_PLAIN_STEPS are measured
    assert decisions == [False] * (BOOTSTRAP_PLAIN_STEPS + 1) + [True]
    assert gov.stats.plain_ms_per_token == pytest.approx(15.625)


def test_bootstrap_is_paid_once_per_governor():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS)
    gov.start_request(100)
    assert gov.should_speculate()


# rule 1 -----------------------------------------------------------------------------------

def test_probe_of_8_steps_won_keeps_speculating():
    gov, loop = bootstrapped()
    assert loop.run(PROBE_STEPS - 1) == [True] * (PROBE_STEPS - 1)
    assert gov.stats.state is GovernorState.PROBE and gov.stats.wins == 0
    loop.step(FAST)
    assert gov.stats.wins == 1 and gov.stats.state is GovernorState.WATCH
    assert loop.run(20) == [True] * 20


def test_probe_of_8_steps_lost_parks():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS - 1, SLOW)
    assert gov.stats.state is GovernorState.PROBE
    loop.step(SLOW)
    assert (gov.stats.losses, gov.stats.state) == (1, GovernorState.PARKED)
    assert not gov.should_speculate()


def test_a_tie_is_a_loss():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, spec=(2 / 64, 2, 1, 3))  # exactly the plain 15.625 ms/token
    assert gov.stats.losses == 1


def test_probe_after_a_loss_is_3_steps():
    gov, loop = bootstrapped()
    lose_probe(loop)
    loop.plain_tokens_until_speculating()
    assert loop.run(REPROBE_STEPS) == [True] * REPROBE_STEPS
    assert gov.stats.wins == 1 and gov.stats.state is GovernorState.WATCH


# rule 2 -----------------------------------------------------------------------------------

def test_park_backs_off_32_64_128_256_and_stays_at_256():
    gov, loop = bootstrapped()
    parks = []
    for _ in range(6):
        lose_probe(loop)
        parks.append(loop.plain_tokens_until_speculating())
    assert parks == [32, 64, 128, 256, 256, 256]
    assert gov.stats.parked_tokens == sum(parks)


def test_park_counts_emitted_tokens_not_steps():
    gov, loop = bootstrapped()
    lose_probe(loop)
    steps = 0
    while not gov.should_speculate():
        loop.step(plain_emitted=4)
        steps += 1
    assert steps == PARK_TOKENS[0] // 4
    assert gov.stats.parked_tokens == PARK_TOKENS[0]


def test_a_win_resets_the_backoff():
    gov, loop = bootstrapped()
    lose_probe(loop)
    loop.plain_tokens_until_speculating()
    loop.run(REPROBE_STEPS, FAST)
    assert gov.stats.state is GovernorState.WATCH
    lose_watch(loop)
    assert gov.stats.losses == 2
    assert loop.plain_tokens_until_speculating() == PARK_TOKENS[0]


# rule 3 -----------------------------------------------------------------------------------

def test_parked_steps_feed_the_baseline_except_the_first_after_speculating():
    gov, loop = bootstrapped()
    lose_probe(loop)
    gov.record_plain_step(10.0)  # polluted by the spec → plain transition: discarded
    assert gov.stats.plain_ms_per_token == pytest.approx(15.625)
    for _ in range(8):
        gov.record_plain_step(1 / 128)  # the machine got faster: 7.8125 ms/token
    assert gov.stats.plain_ms_per_token == pytest.approx(7.8125)


def test_the_first_plain_step_of_a_request_is_discarded():
    gov, loop = bootstrapped()
    lose_probe(loop)
    loop.run(4)
    gov.start_request(100)
    gov.record_plain_step(10.0)  # follows prefill
    assert gov.stats.plain_ms_per_token == pytest.approx(15.625)


# rule 4 -----------------------------------------------------------------------------------

def test_four_steps_with_nothing_accepted_end_a_probe_as_a_loss():
    gov, loop = bootstrapped()
    loop.run(3, NOTHING)  # cheaper per token than plain, but nothing accepted
    assert gov.stats.state is GovernorState.PROBE
    loop.step(NOTHING)
    assert (gov.stats.losses, gov.stats.state) == (1, GovernorState.PARKED)


def test_an_accepted_draft_breaks_the_run_of_nothing_accepted():
    gov, loop = bootstrapped()
    for spec in (NOTHING, NOTHING, NOTHING, FAST, NOTHING, NOTHING, NOTHING):
        loop.step(spec)
    assert gov.stats.state is GovernorState.PROBE and gov.stats.losses == 0


def test_a_step_that_drafted_nothing_is_a_spec_sample_of_one_token():
    gov, loop = bootstrapped()
    loop.step(NOTHING)
    assert gov.stats.spec_ms_per_token == pytest.approx(1000 / 128)


# rule 5 -----------------------------------------------------------------------------------

def test_a_watched_win_parks_as_soon_as_the_last_8_steps_average_a_loss():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, FAST)
    # last 8 = (8-k) FAST + k SLOW: (8+k)/32 s for 24-k tokens, >= 1/64 s per token from k = 8/3 on
    loop.run(2, SLOW)
    assert gov.stats.state is GovernorState.WATCH
    loop.step(SLOW)
    assert (gov.stats.wins, gov.stats.losses, gov.stats.state) == (1, 1, GovernorState.PARKED)


def test_a_watched_win_refreshes_plain_every_64_steps():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, FAST)
    decisions = loop.run(REFRESH_EVERY_STEPS + 3)
    # 64 speculative steps, then should_speculate() is False for one discarded and one measured plain step
    assert decisions == [True] * REFRESH_EVERY_STEPS + [False, False] + [True]
    assert gov.stats.state is GovernorState.WATCH and gov.stats.losses == 0


def test_a_refreshed_baseline_that_beats_speculation_parks():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS + REFRESH_EVERY_STEPS, MARGINAL)
    assert not gov.should_speculate()
    gov.record_plain_step(1.0)  # discarded: first after speculating
    assert gov.stats.state is GovernorState.REFRESH
    gov.record_plain_step(1 / 128)  # baseline (3/64 + 1/128) / 4 s = 13.7 ms/token: the watch loses
    assert (gov.stats.losses, gov.stats.state) == (1, GovernorState.PARKED)


# rules 6 and 7 ----------------------------------------------------------------------------

def test_one_governor_serves_every_request_of_an_engine():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, FAST)
    for _ in range(3):
        gov.start_request(50)
        assert loop.run(5) == [True] * 5
    assert gov.stats.wins == 1


def test_a_new_request_caps_the_remaining_park_at_32():
    gov, loop = bootstrapped()
    for _ in range(3):  # third loss: parked for 128
        lose_probe(loop)
        if gov.stats.losses < 3:
            loop.plain_tokens_until_speculating()
    loop.run(10)
    gov.start_request(1000)
    assert loop.plain_tokens_until_speculating() == PARK_TOKENS[0]


def test_a_new_request_leaves_a_shorter_park_alone():
    gov, loop = bootstrapped()
    lose_probe(loop)
    loop.run(PARK_TOKENS[0] - 5)
    gov.start_request(1000)
    assert loop.plain_tokens_until_speculating() == 5


def test_a_new_request_forgets_the_backoff_except_one_loss():
    gov, loop = bootstrapped()
    for _ in range(4):  # four losses in a row: the next would park for 256
        lose_probe(loop)
        loop.plain_tokens_until_speculating()
    gov.start_request(1000)
    assert loop.run(REPROBE_STEPS, SLOW) == [True] * REPROBE_STEPS  # one loss remembered: short probe
    assert gov.stats.state is GovernorState.PARKED
    assert loop.plain_tokens_until_speculating() == PARK_TOKENS[1]


# rule 8 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens_left", [0, 1])
def test_a_request_that_cannot_decode_two_tokens_is_never_armed(num_tokens_left):
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, FAST)
    gov.start_request(num_tokens_left)
    assert loop.run(3) == [False] * 3
    gov.start_request(2)
    assert gov.should_speculate()


def test_an_unarmed_request_leaves_park_and_backoff_alone():
    gov, loop = bootstrapped()
    for _ in range(2):  # second loss: parked for 64
        lose_probe(loop)
        if gov.stats.losses < 2:
            loop.plain_tokens_until_speculating()
    gov.start_request(1)
    assert tokens_until_unparked(loop) == PARK_TOKENS[1]


# rule 10 ----------------------------------------------------------------------------------

def test_disabled_always_speculates_and_still_reports():
    gov, loop = bootstrapped(enabled=False)
    assert gov.stats.state is GovernorState.OFF
    assert loop.run(40, SLOW) == [True] * 40  # losing and accepting nothing would park if enabled
    assert loop.run(10, NOTHING) == [True] * 10
    assert gov.stats.losses == 0 and gov.stats.parked_tokens == 0
    assert gov.stats.spec_ms_per_token == pytest.approx(1000 / 128)
    assert gov.stats_line() == "governor plain=- spec=7.8ms/tok wins=0 losses=0 parked=0"


def test_disabled_still_never_arms_a_request_that_cannot_decode_two_tokens():
    gov, _ = bootstrapped(enabled=False)
    gov.start_request(1)
    assert not gov.should_speculate()


# rule 12 ----------------------------------------------------------------------------------

def slow_drafting(num_drafted: int, num_extra_plain_steps: float) -> tuple[tuple, float]:
    """A step that accepts everything it drafted, whose drafting alone took the num_drafted
    plain steps (max(num_drafted, 1)) it could save plus `num_extra_plain_steps`; (spec, draft_s)."""
    draft_s = (MAX_DRAFT_STEPS_PER_TOKEN * max(num_drafted, 1) + num_extra_plain_steps) * PLAIN_S
    return (draft_s + PLAIN_S, num_drafted + 1, num_drafted, num_drafted), draft_s


@pytest.mark.parametrize("num_drafted", [0, 1, 4])
def test_drafting_that_costs_more_than_it_could_save_parks_at_once_and_is_reported_once(num_drafted):
    reasons = []
    gov = SpeculationCostGovernor(clock=FakeClock(), on_slow_draft=reasons.append)
    gov.start_request(10_000)
    loop = Loop(gov)
    loop.run(BOOTSTRAP_PLAIN_STEPS + 1)
    spec, draft_s = slow_drafting(num_drafted, 0)  # exactly what it could save: not a loss by itself
    assert loop.step(spec, draft_s=draft_s)
    assert gov.stats.state is GovernorState.PROBE and reasons == []
    spec, draft_s = slow_drafting(num_drafted, 1 / 8)
    assert loop.step(spec, draft_s=draft_s)
    assert (gov.stats.losses, gov.stats.state) == (1, GovernorState.PARKED)  # not PROBE_STEPS later
    assert reasons == [{  # 1 + 1/8 or 4 + 1/8 plain steps of 15.625 ms
        0: "propose took 18 ms and drafted nothing, more than the 16 ms of the 1 plain decode step",
        1: "propose took 18 ms to draft 1 token, more than the 16 ms of the 1 plain decode step",
        4: "propose took 64 ms to draft 4 tokens, more than the 62 ms of the 4 plain decode steps",
    }[num_drafted] + " it could save"]
    assert loop.plain_tokens_until_speculating() == PARK_TOKENS[0]  # rule 2's park
    assert loop.step(spec, draft_s=draft_s)  # the re-probe: parked at its first step, not reported again
    assert (gov.stats.losses, gov.stats.state, len(reasons)) == (2, GovernorState.PARKED, 1)
    assert loop.plain_tokens_until_speculating() == PARK_TOKENS[1]


def test_slow_drafting_parks_a_watched_win():
    gov, loop = bootstrapped()
    loop.run(PROBE_STEPS, FAST)
    assert gov.stats.state is GovernorState.WATCH
    spec, draft_s = slow_drafting(4, 1 / 8)
    loop.step(spec, draft_s=draft_s)  # one step: the watched average of 8 would still win
    assert (gov.stats.wins, gov.stats.losses, gov.stats.state) == (1, 1, GovernorState.PARKED)


def test_slow_drafting_never_parks_a_disabled_governor():
    gov, loop = bootstrapped(enabled=False)
    for _ in range(BOOTSTRAP_PLAIN_STEPS + 1):
        gov.record_plain_step(PLAIN_S)
    spec, draft_s = slow_drafting(4, 100)
    assert [loop.step(spec, draft_s=draft_s) for _ in range(3)] == [True] * 3  # rule 10
    assert gov.stats.losses == 0


# the report --------------------------------------------------------------------------------

def test_stats_line():
    gov = SpeculationCostGovernor(clock=FakeClock())
    assert gov.stats_line() == "governor plain=- spec=- wins=0 losses=0 parked=0"
    gov.start_request(1000)
    for _ in range(BOOTSTRAP_PLAIN_STEPS + 1):
        gov.record_plain_step(0.0153)
    for _ in range(PROBE_STEPS):
        gov.record_spec_step(0.0582, num_emitted=2, num_accepted=1, num_drafted=4)
    lost = gov.stats
    assert (lost.state, lost.wins, lost.losses) == (GovernorState.PARKED, 0, 1)
    for _ in range(20):
        gov.record_plain_step(0.0153)
    assert gov.stats_line() == "governor plain=15.3ms/tok spec=29.1ms/tok wins=0 losses=1 parked=20"


@pytest.mark.parametrize("args", [(-1.0, 1, 0, 0), (0.01, 0, 0, 0), (0.01, 2, 3, 2), (0.01, 2, -1, 2),
                                  (0.01, 1, 0, 0, -0.001), (0.01, 1, 0, 0, 0.02)])
def test_a_bad_spec_step_record_is_refused(args):
    with pytest.raises(InvalidStepRecord, match="record_spec_step"):
        SpeculationCostGovernor(clock=FakeClock()).record_spec_step(*args)


@pytest.mark.parametrize("args", [(-1.0, 1), (0.01, 0)])
def test_a_bad_plain_step_record_is_refused(args):
    with pytest.raises(InvalidStepRecord, match="record_plain_step"):
        SpeculationCostGovernor(clock=FakeClock()).record_plain_step(*args)


# rule 11 ----------------------------------------------------------------------------------

def test_a_request_resuming_after_a_batched_interlude_is_not_a_new_request():
    def parked_at_63():
        gov, loop = bootstrapped()
        lose_probe(loop)
        tokens_until_unparked(loop)
        lose_probe(loop)  # the second loss parks for 64 tokens
        loop.step()
        return gov, loop

    gov, loop = parked_at_63()
    gov.resume_request(1000)
    assert tokens_until_unparked(loop) == 63  # the park is kept
    gov, loop = parked_at_63()
    gov.start_request(1000)
    assert tokens_until_unparked(loop) == PARK_TOKENS[0]  # a new request would cap it

    gov, loop = parked_at_63()
    baseline = gov.stats.plain_ms_per_token
    loop.plain_s = 1 / 8
    gov.resume_request(1000)
    loop.step()  # follows the interlude: not measured
    assert gov.stats.plain_ms_per_token == baseline
    loop.step()
    assert gov.stats.plain_ms_per_token > baseline

    gov, loop = bootstrapped(enabled=False)
    gov.resume_request(1)
    assert not gov.should_speculate()
    gov.resume_request(2)
    assert gov.should_speculate()


def test_the_park_reason_names_the_rule_that_parked():
    """Each rule that parks leaves its own line in GovernorStats.park_reason (the request's reason
    quotes it), not always the cost comparison."""
    clock = FakeClock()
    gov = SpeculationCostGovernor(clock=clock)
    assert gov.stats.park_reason is None
    for _ in range(BOOTSTRAP_PLAIN_STEPS + 1):
        gov.record_plain_step(0.010)
    for _ in range(MAX_ZERO_ACCEPT_STEPS):
        gov.record_spec_step(0.005, num_emitted=1, num_accepted=0, num_drafted=2)
    assert gov.stats.state is GovernorState.PARKED
    assert gov.stats.park_reason == f"rule 4: {MAX_ZERO_ACCEPT_STEPS} speculative steps in a row accepted nothing"
    for _ in range(PARK_TOKENS[0]):
        gov.record_plain_step(0.010)
    gov.record_spec_step(0.050, num_emitted=2, num_accepted=1, num_drafted=1, draft_s=0.040)
    assert gov.stats.park_reason.startswith("rule 12: propose took 40 ms to draft 1 token")
