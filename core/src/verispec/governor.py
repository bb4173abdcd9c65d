"""SpeculationCostGovernor: speculation must never make decoding slower (docs/design.md §3).

It sits beside the loop. Before each step the loop asks `should_speculate()`; it times the
step (and a speculative step's drafting on its own) with `gov.clock` and reports it with
`record_spec_step` or `record_plain_step`. The governor compares milliseconds per emitted
token of speculative steps against plain steps (the model's own decode) and parks drafting
while speculation loses. Units: elapsed times come in as seconds, rates go out as ms per
emitted token, park lengths count emitted tokens.

States (`GovernorState`): bootstrap → probe → watch ⇄ refresh, probe/watch → parked → probe;
`off` when built with enabled=False.

Rules (each has a test in tests/test_governor.py):
 1. A probe is PROBE_STEPS speculative steps (REPROBE_STEPS while a loss is remembered);
    then spec ms/token < plain ms/token is a win (keep speculating, watched), else a loss (park).
 2. A loss parks for PARK_TOKENS[i] emitted tokens, i = successive losses - 1, capped at the
    last entry: 32 → 64 → 128 → 256 → 256. A win resets the run of losses.
 3. Every plain step feeds the plain baseline (the mean of the last PLAIN_WINDOW_STEPS),
    except the first plain step after anything that is not a plain step — a speculative step,
    or the prefill that starts a request — whose timing is polluted by the transition.
 4. MAX_ZERO_ACCEPT_STEPS speculative steps in a row with nothing accepted end a probe as a
    loss. A step whose head proposed nothing, whose lookup found no match, or whose draft length
    was 0 (the cost model: drafting does not pay) is reported by the loop as a speculative
    sample of one token with nothing accepted.
 5. A win is watched: after every speculative step the last WATCH_STEPS speculative steps
    (fewer right after a short probe) are compared with the baseline, and a loss parks at once.
    Every REFRESH_EVERY_STEPS speculative steps `should_speculate()` answers False for
    REFRESH_PLAIN_STEPS steps: the loop decodes plainly, the first of those is discarded
    (rule 3), the second refreshes the baseline, and the watch is re-judged against it.
 6. One governor per (model, drafter, backend), shared by all requests of an engine: state,
    baseline and counters live on the object and survive `start_request`.
 7. A new request caps any remaining park at PARK_TOKENS[0] and keeps at most
    REMEMBERED_LOSSES of the run of losses: the next loss parks for PARK_TOKENS[1] (64),
    and the next probe is short (REPROBE_STEPS).
 8. A request with num_tokens_left < MIN_TOKENS_TO_ARM is never armed: `should_speculate()`
    is False for all of it, and it changes neither the park nor the backoff (its plain steps
    still feed the baseline and count against a park).
 9. Bootstrap (no baseline yet, the engine's very first request): measure plain first.
    The governor asks for plain steps until BOOTSTRAP_PLAIN_STEPS have been measured (so
    BOOTSTRAP_PLAIN_STEPS + 1 steps with the discarded first one), then probes. A probe's
    verdict then never waits on a baseline, and the bootstrap is paid once per engine.
10. enabled=False (`--spec-adaptive off`): `should_speculate()` is True for every armed
    request; steps are still measured and `stats_line()` still reports them.
11. A request that resumes after steps the governor did not see (it decoded in a batch beside
    other requests: `resume_request`) is not a new request: park and backoff stay as they
    are; its first plain step follows a transition and is not measured (rule 3), and with
    fewer than MIN_TOKENS_TO_ARM tokens left it is not armed (rule 8).
12. A speculative step whose drafting alone (`draft_s`, the loop's timing of `propose`) took
    more than MAX_DRAFT_STEPS_PER_TOKEN plain steps per token it could save loses at once, in a
    probe or a watch (rule 2's park). It could save max(num_drafted, 1) plain steps: every draft
    accepted, and a step that drafted nothing counts as one (rule 4's sample of one token), so a
    lookup's microseconds never trip it. The first such loss in the governor's life calls
    `on_slow_draft` with a one-line reason, once: a slow plugin is named once, not at every
    re-probe.
"""
from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable

import attrs

log = logging.getLogger("verispec")

#: speculative steps in a first probe (rule 1).
PROBE_STEPS = 8
#: speculative steps in a probe while a loss is remembered (rule 1).
REPROBE_STEPS = 3
#: park lengths in emitted tokens, by successive losses; the last one repeats (rule 2).
PARK_TOKENS = (32, 64, 128, 256)
#: speculative steps in a row with nothing accepted that end a probe as a loss (rule 4).
MAX_ZERO_ACCEPT_STEPS = 4
#: speculative steps averaged while a win is watched (rule 5).
WATCH_STEPS = 8
#: speculative steps between plain refreshes while winning (rule 5).
REFRESH_EVERY_STEPS = 64
#: plain steps per refresh: the first is discarded as polluted, the second measured (rules 3, 5).
REFRESH_PLAIN_STEPS = 2
#: measured plain steps before the very first probe (rule 9).
BOOTSTRAP_PLAIN_STEPS = 3
#: plain steps averaged into the baseline (recent ones: decode slows as the context grows).
PLAIN_WINDOW_STEPS = 8
#: a request must be able to decode this many tokens to be armed (rule 8).
MIN_TOKENS_TO_ARM = 2
#: losses a new request remembers of the run (rule 7).
REMEMBERED_LOSSES = 1
#: plain steps of drafting per token a speculative step could save, at most (rule 12).
MAX_DRAFT_STEPS_PER_TOKEN = 1.0


class GovernorState(enum.Enum):
    BOOTSTRAP = "bootstrap"  # no baseline yet: plain steps
    PROBE = "probe"  # speculating toward a verdict
    WATCH = "watch"  # won: speculating, re-judged every step
    REFRESH = "refresh"  # won: a few plain steps to refresh the baseline
    PARKED = "parked"  # lost: plain steps until the park is used up
    OFF = "off"  # enabled=False: always speculate


class InvalidStepRecord(ValueError):
    """A step report the governor cannot use (negative time, no token emitted, accepted > drafted)."""


@attrs.frozen
class GovernorStats:
    """A snapshot of the governor; `line()` is what the engine prints once per turn."""

    #: mean of the recent plain steps, ms per emitted token; None before any is measured.
    plain_ms_per_token: float | None
    #: mean of the recent speculative steps (the current probe or watch), ms per emitted token.
    spec_ms_per_token: float | None
    #: probes won and losses (probe or watch), over the governor's life.
    wins: int
    losses: int
    #: tokens emitted while parked, over the governor's life.
    parked_tokens: int
    state: GovernorState
    #: tokens the current park still lasts (0 unless parked).
    park_tokens_left: int = 0
    #: the rule that parked drafting last, with its numbers ("rule 4: 4 speculative steps in a row
    #: accepted nothing"); None before any loss.
    park_reason: str | None = None

    def line(self) -> str:
        """`governor plain=15.3ms/tok spec=29.1ms/tok wins=0 losses=2 parked=96` ("-" when unmeasured)."""
        def rate(ms):
            return "-" if ms is None else f"{ms:.1f}ms/tok"
        return (f"governor plain={rate(self.plain_ms_per_token)} spec={rate(self.spec_ms_per_token)} "
                f"wins={self.wins} losses={self.losses} parked={self.parked_tokens}")


def _ms(ms: float) -> str:
    """`500 ms`, `104 ms`, `0.21 ms`: whole milliseconds from 10 ms up, two significant digits below."""
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


class _Rate:
    """The last `maxlen` steps as (elapsed_s, num_emitted); their mean in ms per emitted token."""

    def __init__(self, maxlen: int):
        self._samples: deque[tuple[float, int]] = deque(maxlen=maxlen)

    def add(self, elapsed_s: float, num_emitted: int) -> None:
        self._samples.append((elapsed_s, num_emitted))

    def clear(self) -> None:
        self._samples.clear()

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def ms_per_token(self) -> float | None:
        if not self._samples:
            return None
        return 1000.0 * sum(s for s, _ in self._samples) / sum(n for _, n in self._samples)


class SpeculationCostGovernor:
    """Decides per step whether to speculate, from measured ms per emitted token (rules above).

    clock: seconds, monotonic (`time.perf_counter`); the loop times its steps with it.
    enabled: False forces speculation for measurements (`--spec-adaptive off`).
    on_slow_draft: called once with a one-line reason when drafting first loses alone (rule 12);
      default: a logged warning (the engine passes one that names the speculator).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, enabled: bool = True,
                 on_slow_draft: Callable[[str], None] | None = None):
        self.clock = clock
        self.enabled = enabled
        self._on_slow_draft = on_slow_draft or (
            lambda reason: log.warning("%s; parked, decoding plainly", reason))
        self._slow_draft_reported = False
        self._plain = _Rate(PLAIN_WINDOW_STEPS)
        self._spec = _Rate(WATCH_STEPS)  # cleared when a probe starts: holds the probe, then the watch
        self._state = GovernorState.BOOTSTRAP if enabled else GovernorState.OFF
        self._armed = True
        self._last_step_plain = False  # rule 3: a plain step is measured only after a plain step
        self._losses_in_a_row = 0
        self._probe_left = 0  # speculative steps
        self._zero_accept_run = 0  # speculative steps
        self._park_left = 0  # emitted tokens
        self._steps_since_refresh = 0  # speculative steps
        self._refresh_left = 0  # plain steps
        self._wins = self._losses = self._parked_tokens = 0
        self._park_reason: str | None = None

    # -- the loop's interface ------------------------------------------------------------

    def start_request(self, num_tokens_left: int) -> None:
        """A new request that may still emit `num_tokens_left` tokens (rules 7 and 8)."""
        self._armed = num_tokens_left >= MIN_TOKENS_TO_ARM
        self._last_step_plain = False  # its first decode follows prefill
        if not self._armed:
            return
        self._losses_in_a_row = min(self._losses_in_a_row, REMEMBERED_LOSSES)
        if self._state is GovernorState.PARKED:
            self._park_left = min(self._park_left, PARK_TOKENS[0])

    def resume_request(self, num_tokens_left: int) -> None:
        """The current request continues after steps this governor did not time (rule 11)."""
        self._armed = num_tokens_left >= MIN_TOKENS_TO_ARM
        self._last_step_plain = False

    def should_speculate(self) -> bool:
        """Asked before each step: True to take a speculative step, False for a plain one."""
        return self._armed and self._state in (GovernorState.PROBE, GovernorState.WATCH, GovernorState.OFF)

    def plain_cause(self) -> str:
        """Why `should_speculate()` is False (verispec.reasons): "too_short" (rule 8), "parked", or
        "measuring" (the bootstrap, or a refresh)."""
        if not self._armed:
            return "too_short"
        return "parked" if self._state is GovernorState.PARKED else "measuring"

    def record_spec_step(self, elapsed_s: float, num_emitted: int, num_accepted: int,
                         num_drafted: int, draft_s: float = 0.0) -> None:
        """A speculative step took `elapsed_s` seconds, `draft_s` of them drafting, and emitted
        `num_emitted` tokens.

        A step that drafted nothing is (elapsed_s, 1, 0, 0): a speculative sample of one token.
        Raises InvalidStepRecord for elapsed_s < 0, num_emitted < 1, not 0 <= accepted <= drafted
        or not 0 <= draft_s <= elapsed_s.
        """
        if (elapsed_s < 0 or num_emitted < 1 or not 0 <= num_accepted <= num_drafted
                or not 0 <= draft_s <= elapsed_s):
            raise InvalidStepRecord(
                f"record_spec_step({elapsed_s=}, {num_emitted=}, {num_accepted=}, {num_drafted=}, "
                f"{draft_s=}): report seconds >= 0, at least one emitted token, 0 <= accepted <= drafted and "
                "0 <= draft_s <= elapsed_s")
        self._last_step_plain = False
        self._spec.add(elapsed_s, num_emitted)
        speculating = self._state in (GovernorState.PROBE, GovernorState.WATCH)
        slow = self._draft_loses(draft_s, num_drafted) if speculating else None
        if slow is not None:
            self._lose(f"rule 12: {slow}")
        elif self._state is GovernorState.PROBE:
            self._zero_accept_run = self._zero_accept_run + 1 if num_accepted == 0 else 0
            self._probe_left -= 1
            if self._zero_accept_run >= MAX_ZERO_ACCEPT_STEPS:
                self._lose(f"rule 4: {MAX_ZERO_ACCEPT_STEPS} speculative steps in a row accepted nothing")
            elif self._probe_left == 0:
                self._judge_probe()
        elif self._state is GovernorState.WATCH:
            self._steps_since_refresh += 1
            if not self._spec_wins():
                self._lose(self._cost_rule("rule 5: watched"))
            elif self._steps_since_refresh >= REFRESH_EVERY_STEPS:
                self._state, self._refresh_left = GovernorState.REFRESH, REFRESH_PLAIN_STEPS

    def record_plain_step(self, elapsed_s: float, num_emitted: int = 1) -> None:
        """A plain step (the model's own decode) took `elapsed_s` seconds and emitted `num_emitted` tokens.

        Raises InvalidStepRecord for elapsed_s < 0 or num_emitted < 1.
        """
        if elapsed_s < 0 or num_emitted < 1:
            raise InvalidStepRecord(f"record_plain_step({elapsed_s=}, {num_emitted=}): "
                                    "report seconds >= 0 and at least one emitted token")
        if self._last_step_plain:
            self._plain.add(elapsed_s, num_emitted)
        self._last_step_plain = True
        if self._state is GovernorState.PARKED:
            self._parked_tokens += num_emitted
            self._park_left -= num_emitted
            if self._park_left <= 0:
                self._start_probe()
        elif self._state is GovernorState.BOOTSTRAP:
            if len(self._plain) >= BOOTSTRAP_PLAIN_STEPS:
                self._start_probe()
        elif self._state is GovernorState.REFRESH:
            self._refresh_left -= 1
            if self._refresh_left == 0:
                self._state, self._steps_since_refresh = GovernorState.WATCH, 0
                if not self._spec_wins():
                    self._lose(self._cost_rule("rule 5: re-judged after a plain refresh"))

    @property
    def stats(self) -> GovernorStats:
        return GovernorStats(plain_ms_per_token=self._plain.ms_per_token,
                             spec_ms_per_token=self._spec.ms_per_token,
                             wins=self._wins, losses=self._losses, parked_tokens=self._parked_tokens,
                             state=self._state,
                             park_tokens_left=self._park_left if self._state is GovernorState.PARKED else 0,
                             park_reason=self._park_reason)

    def stats_line(self) -> str:
        return self.stats.line()

    # -- verdicts ------------------------------------------------------------------------

    def _spec_wins(self) -> bool:
        """Recent speculative steps cost strictly less per emitted token than plain ones (a tie loses)."""
        spec, plain = self._spec.ms_per_token, self._plain.ms_per_token
        return spec is not None and plain is not None and spec < plain

    def _draft_loses(self, draft_s: float, num_drafted: int) -> str | None:
        """Rule 12: drafting alone cost more than the plain steps the step could save: the line
        saying so, else None. Reports the first such step through on_slow_draft."""
        num_savable = max(num_drafted, 1)
        limit_ms = MAX_DRAFT_STEPS_PER_TOKEN * num_savable * self._plain.ms_per_token  # set after the bootstrap
        if 1e3 * draft_s <= limit_ms:
            return None
        drafted = f"to draft {num_drafted} token{'s' * (num_drafted > 1)}" if num_drafted else "and drafted nothing"
        steps = f"{num_savable} plain decode step{'s' * (num_savable > 1)}"
        line = f"propose took {_ms(1e3 * draft_s)} {drafted}, more than the {_ms(limit_ms)} of the {steps} it could save"
        if not self._slow_draft_reported:
            self._slow_draft_reported = True
            self._on_slow_draft(line)
        return line

    def _cost_rule(self, rule: str) -> str:
        """`rule`'s verdict as a line: speculative steps' ms per token against plain's."""
        spec, plain = self._spec.ms_per_token, self._plain.ms_per_token
        return (f"{rule}, speculating cost {'-' if spec is None else f'{spec:.1f}'} ms/token, not under plain "
                f"decoding's {'-' if plain is None else f'{plain:.1f}'} ms/token")

    def _judge_probe(self) -> None:
        if not self._spec_wins():
            self._lose(self._cost_rule("rule 1: a probe"))
            return
        self._wins += 1
        self._losses_in_a_row = 0
        self._state, self._steps_since_refresh = GovernorState.WATCH, 0

    def _lose(self, reason: str) -> None:
        self._park_reason = reason
        self._losses += 1
        self._losses_in_a_row += 1
        self._park_left = PARK_TOKENS[min(self._losses_in_a_row, len(PARK_TOKENS)) - 1]
        self._state = GovernorState.PARKED

    def _start_probe(self) -> None:
        self._state = GovernorState.PROBE
        self._probe_left = REPROBE_STEPS if self._losses_in_a_row else PROBE_STEPS
        self._zero_accept_run = 0
        self._spec.clear()
