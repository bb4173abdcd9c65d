"""CostModel: how many drafts each request verifies this step, from measured costs (docs/design.md §3).

Speculation is worth a step only when it emits more tokens per second than plain decoding of
the same requests. A step forwards, per decoding request i, its pending token and k_i drafts
(k_i = 0: a plain row), beside any prefill rows P. With N decoding requests, B = Σ k_i draft
rows, and requests that draft D = {i : k_i > 0}:

    value(k) = (N + Σ_i S_i(k_i)) / (forward(N + P + B) + Σ_{i∈D} (propose(k_i) + upkeep · E_i(k_i)))

where S_i(k) = α_i + α_i² + … + α_i^k is the expected number of request i's drafts accepted
(each draft survives when it and every draft before it pass, with probability α_i each,
independently: Leviathan et al. 2023, arXiv 2211.17192, eq. 1), E_i(k) = 1 + S_i(k) its expected
emitted tokens (the correction or bonus token included). `plan` picks the k that maximises
value(k): it ranks every (request, draft position j) slot by its survival α_i^j and admits the
best B slots, for the B (0 .. every slot) of highest value — vLLM's adaptive verification
(vllm-project/vllm PR #47808) with the drafter's own cost and upkeep in the denominator. B = 0,
every request plain, is always a candidate: value = N / forward(N + P), and a plan with drafts
must beat it by PLAN_MARGIN (3 %). Ties go to fewer slots.

The costs, in seconds, all measured on this engine (nothing is guessed once measured):

- forward(n): a trunk forward of n rows. `profile` times n = 1..K + 1 rows, and 2(K + 1) and
  4(K + 1) once (a scratch sequence, about a second on the default model): the shape. Every
  real step then rescales it by its time over the profile's for its row count (a running mean,
  COST_EMA_WEIGHT): real contexts make every row dearer than the profile's, and one scale keeps
  counts no step has used priced alike. Read as a non-decreasing line: between measured
  counts, linear interpolation; past the largest, the mean slope. Without a profile (tests),
  real steps fill the table themselves.
- propose(k): the drafter's `propose` for a bound of k drafts, a running mean per k; an
  unmeasured k interpolates linearly from the measured ones (0 before any). The first
  COLD_PROPOSE_CALLS calls of an engine are discarded: a cold call (allocation, first-touch
  of a head's weights) is never judged, unless it took more than COLD_SLACK one-row forwards
  (a stall, not a warm-up: judged at once).
- upkeep: seconds per committed row of the drafter's own work outside `propose` (`commit`,
  `prepare`: a head's Pass A/B, a draft model's catch-up rows), a running mean.

α_i comes from the request's own `Acceptance`, with a prior until it has drafted. A drafter that
scores its drafts (SpeculatorSpec.scores_drafts) proposes before the plan, and its request's
slots are the proposal's own survivals instead: s_j = c(p_1) · … · c(p_j), with p_j the
drafter's probability of draft j given the drafts before it and c the engine's `Calibration` of
such probabilities to measured acceptance; its propose is already paid (0 in the plan).
"""
from __future__ import annotations

import bisect
import itertools
import math
import time

#: how much more tokens per second than plain a plan with drafts must promise (the model's own
#: error: a tie, or a gain inside measurement noise, stays plain).
PLAN_MARGIN = 1.03
#: weight of a new measurement in a running mean of seconds.
COST_EMA_WEIGHT = 0.25
#: propose calls of an engine whose timing is discarded (cold: first allocations, caches), unless
#: slower than COLD_SLACK one-row forwards (a stall is never excused as cold).
COLD_PROPOSE_CALLS = 2
COLD_SLACK = 20.0
#: timed passes over the row counts in `profile` (after one untimed warm-up forward); each count keeps
#: its least time (a burst of other load on a shared machine is not the trunk's cost).
PROFILE_PASSES = 2
#: one more verify row relative to one row, before anything is measured (the memory-bound slope of an
#: int8 trunk on a CPU: docs/reference/baselines.md §5).
PRIOR_ROW_COST = 0.06
#: weight kept by a request's acceptance evidence per step (≈ the last 5 steps count).
ACCEPT_DECAY = 0.8
#: prior acceptance rate, worth PRIOR_JUDGED judged drafts of evidence.
PRIOR_ACCEPT_RATE = 0.5
PRIOR_JUDGED = 2.0
#: a request's own judged drafts before its estimate alone plans its drafts; until then the plan
#: uses at least OPTIMISTIC_ALPHA with at most PROBE_MAX_DRAFTS drafts a step, so every request is
#: measured (cheaply: two rejected drafts suffice) before the prior can stop it.
MIN_OWN_JUDGED = 2
OPTIMISTIC_ALPHA = 0.8
PROBE_MAX_DRAFTS = 2
#: weight kept by the drafter's engine-wide acceptance per verify (≈ the last 50 verifies count), and
#: the judged drafts it needs before it is a new request's prior.
DRAFTER_DECAY = 0.98
DRAFTER_MIN_JUDGED = 8.0
#: weight kept per step the plan gave no draft: the estimate drifts back to the prior over tens of steps.
SKIP_DECAY = 0.95
#: upper edges of the drafter-probability bins a `Calibration` measures (the last bin ends at 1).
CALIBRATION_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)


def expected_accepted(alpha: float, k: int) -> float:
    """S(k) = α + α² + … + α^k: expected accepted drafts of k at per-draft acceptance α."""
    return sum(alpha ** j for j in range(1, k + 1))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + COST_EMA_WEIGHT * (new - old)


class _Table:
    """Running means of seconds by count, read as a non-decreasing line: each measured count's
    value is the largest mean at or below it (more rows never cost less: measurement noise is
    not a discount); between measured counts, linear interpolation; past the largest, the mean
    slope over the measured range; below the smallest, its value (or `zero` at 0 when given:
    propose(0) = 0)."""

    def __init__(self, zero: float | None = None):
        self.means: dict[int, float] = {}
        self._zero = zero
        self._keys: list[int] = []
        self._values: list[float] = []

    def record(self, n: int, seconds: float) -> None:
        self.means[n] = _ema(self.means.get(n), seconds)
        points = self.means if self._zero is None else {0: self._zero} | self.means
        self._keys = sorted(points)
        self._values = list(itertools.accumulate((points[k] for k in self._keys), max))

    def __bool__(self) -> bool:
        return bool(self.means)

    def __call__(self, n: int) -> float:
        keys, values = self._keys, self._values
        i = bisect.bisect_left(keys, n)
        if i < len(keys) and keys[i] == n:
            return values[i]
        if i == 0:
            return values[0]
        if i < len(keys):
            lo, hi = keys[i - 1], keys[i]
            return values[i - 1] + (values[i] - values[i - 1]) * (n - lo) / (hi - lo)
        if len(keys) == 1:
            return values[-1]
        slope = (values[-1] - values[0]) / (keys[-1] - keys[0])
        return values[-1] + slope * (n - keys[-1])


class Acceptance:
    """One request's per-draft acceptance α, from its accepted prefixes.

    A step that accepts a of K drafts judged a + 1 drafts when a < K (a passes, then one
    rejection; the drafts after it were never judged) and K when a = K, so α = Σ passes / Σ
    judged, the maximum-likelihood estimate of a geometric run truncated at K. Both sums decay by
    ACCEPT_DECAY per step (the estimate follows the text) and start from PRIOR_JUDGED drafts at
    the prior rate (`prior`: the drafter's acceptance over this engine's earlier requests,
    CostModel.drafter_alpha; PRIOR_ACCEPT_RATE without one). A step that drafted nothing (`skip`)
    decays the evidence toward the prior, so a request the model said not to draft for is
    measured again after some steps.
    """

    def __init__(self, prior: float | None = None) -> None:
        self.prior = PRIOR_ACCEPT_RATE if prior is None else prior
        self._optimistic = OPTIMISTIC_ALPHA if prior is None else prior
        self._passed = self.prior * PRIOR_JUDGED
        self._judged = PRIOR_JUDGED
        self._own = 0  # drafts of this request judged so far
        #: its own drafts have been judged MIN_OWN_JUDGED times: its estimate plans from now on.
        self.measured = False

    @property
    def alpha(self) -> float:
        """The estimate α."""
        return self._passed / self._judged

    @property
    def planning_alpha(self) -> float:
        """What the plan uses: α once the request is `measured`; before, at least the drafter's
        acceptance on this engine so far (`prior`), or OPTIMISTIC_ALPHA for an engine's first
        requests (optimism under uncertainty: a drafter is measured before a guess can stop it)."""
        return self.alpha if self.measured else max(self.alpha, self._optimistic)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verify of `num_drafted` drafts accepted `num_accepted` of them (0 <= accepted <= drafted)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"record({num_drafted=}, {num_accepted=}): report 0 <= accepted <= drafted")
        if num_drafted:
            judged = num_accepted + (num_accepted < num_drafted)
            self._passed = ACCEPT_DECAY * self._passed + num_accepted
            self._judged = ACCEPT_DECAY * self._judged + judged
            self._own += judged
            self.measured = self._own >= MIN_OWN_JUDGED

    def skip(self) -> None:
        """A step the plan gave no draft: the estimate drifts toward the prior (SKIP_DECAY), so a
        text that changes is tried again when its (decayed) estimate says drafting may pay."""
        self._passed = SKIP_DECAY * self._passed + (1 - SKIP_DECAY) * self.prior * PRIOR_JUDGED
        self._judged = SKIP_DECAY * self._judged + (1 - SKIP_DECAY) * PRIOR_JUDGED


class Calibration:
    """What a scoring drafter's probabilities are worth on this engine: per bin of the drafter's
    probability p of a draft (given the drafts before it; bins end at CALIBRATION_EDGES and 1),
    the measured acceptance of drafts in that bin, passed / judged, a draft judged as in
    `Acceptance.record` (the drafts up to the first rejection). Both sums decay by DRAFTER_DECAY
    per judged draft of their bin and start from PRIOR_JUDGED drafts at the bin's middle p (the
    drafter is believed until measured: optimism under uncertainty, as `Acceptance`'s). As with
    `Acceptance`, the belief is tried cheaply: while a bin has fewer than MIN_OWN_JUDGED judged
    drafts of its own, a proposal reaching it offers the plan at most PROBE_MAX_DRAFTS drafts."""

    def __init__(self) -> None:
        lows = (0.0, *CALIBRATION_EDGES)
        highs = (*CALIBRATION_EDGES, 1.0)
        self._passed = [PRIOR_JUDGED * (lo + hi) / 2 for lo, hi in zip(lows, highs)]
        self._judged = [PRIOR_JUDGED] * len(self._passed)
        self._own = [0] * len(self._passed)  # judged drafts per bin, undecayed

    @staticmethod
    def _bin(p: float) -> int:
        return bisect.bisect_right(CALIBRATION_EDGES, p)

    def alpha(self, p: float) -> float:
        """The measured acceptance of drafts the drafter gave probability p (0 <= p <= 1)."""
        b = self._bin(p)
        return self._passed[b] / self._judged[b]

    def survivals(self, probs: list[float]) -> list[float]:
        """[s_1 .. s_k]: s_j = alpha(p_1) · … · alpha(p_j), the chance that drafts 1..j all pass;
        only the first PROBE_MAX_DRAFTS while a bin among the probs is unmeasured (class docstring)."""
        if any(self._own[self._bin(p)] < MIN_OWN_JUDGED for p in probs):
            probs = probs[:PROBE_MAX_DRAFTS]
        return list(itertools.accumulate((self.alpha(p) for p in probs), lambda a, b: a * b))

    def record(self, probs: list[float], num_accepted: int) -> None:
        """A verify of drafts scored `probs` accepted the first `num_accepted` of them."""
        if not 0 <= num_accepted <= len(probs):
            raise ValueError(f"record({len(probs)} drafts, {num_accepted=}): report 0 <= accepted <= drafts")
        for j, p in enumerate(probs[:num_accepted + 1]):
            b = self._bin(p)
            self._passed[b] = DRAFTER_DECAY * self._passed[b] + (j < num_accepted)
            self._judged[b] = DRAFTER_DECAY * self._judged[b] + 1
            self._own[b] += 1

    def summary(self) -> dict:
        """Measured acceptance by bin, keyed by the bin's upper edge."""
        return {hi: round(passed / judged, 3)
                for hi, passed, judged in zip((*CALIBRATION_EDGES, 1.0), self._passed, self._judged)}


class CostModel:
    """Measured step costs of one engine (trunk and drafter), and the per-step draft plan.

    max_draft_tokens: the K ceiling (>= 1). adaptive: False forces drafting (--spec-adaptive off,
    for measurements): `plan` then gives every request its whole limit, whatever it costs.
    clock: seconds, monotonic. Raises ValueError for max_draft_tokens < 1.
    """

    def __init__(self, max_draft_tokens: int, *, adaptive: bool = True, clock=time.perf_counter):
        if max_draft_tokens < 1:
            raise ValueError(f"CostModel({max_draft_tokens=}): give max_draft_tokens >= 1")
        self.max_draft_tokens, self.adaptive, self.clock = max_draft_tokens, adaptive, clock
        self._forward_s = _Table()  # rows -> running mean of seconds (the profile's, once profiled)
        #: real steps' time over the profile's for their row count, a running mean: the profile's
        #: shape at this engine's contexts (a verify at 500 positions costs more than at 1)
        self._scale = 1.0
        self._propose_s = _Table(zero=0.0)  # k bound -> running mean of seconds
        self._upkeep_s_per_row: float | None = None
        self._propose_calls = 0
        self._passed = self._judged = 0.0  # every request's judged drafts, decayed by DRAFTER_DECAY
        #: a scoring drafter's probabilities against its measured acceptance (the module docstring)
        self.calibration = Calibration()
        self.profiled = False

    # -- measurements -------------------------------------------------------------------------

    def profile(self, trunk) -> None:
        """Time verify forwards of 1 .. K + 1 rows in PROFILE_PASSES interleaved passes, keeping
        each count's least time, and of 2 (K + 1) and 4 (K + 1) rows once (a batch's draft rows),
        on a scratch sequence released after; once, later calls do nothing. Load that lasts is
        followed by `record_forward`'s rescaling from real steps."""
        if self.profiled:
            return
        self.profiled = True
        from verispec.seams import Segment

        widest = self.max_draft_tokens + 1
        room = trunk.max_context_length - 1  # a short context bounds the rows a verify may take
        counts = [n for n in range(1, widest + 1) if n <= room]
        least: dict[int, float] = {}
        seq = trunk.new_sequence()
        try:
            trunk.forward([Segment(seq, [0], logits="last")])  # one committed row; untimed warm-up
            schedule = counts * PROFILE_PASSES + [n for n in (2 * widest, 4 * widest) if n <= room]
            for n in schedule:
                start = self.clock()
                trunk.forward([Segment(seq, [0] * n, logits="all", verify=True)])
                least[n] = min(least.get(n, math.inf), self.clock() - start)
                trunk.keep(seq, 0)  # a verify that accepted nothing: the sequence is back to one row
        finally:
            trunk.release(seq)
        for n in sorted(least):
            self._forward_s.record(n, least[n])

    def record_forward(self, num_rows: int, seconds: float) -> None:
        """A forward of `num_rows` rows took `seconds`: it rescales the profile (once profiled: its
        shape by row count, scaled to what real steps cost), else it is the table itself."""
        if num_rows < 1 or seconds < 0:
            return
        if self.profiled:
            self._scale = _ema(self._scale, seconds / self._forward_s(num_rows))
        else:
            self._forward_s.record(num_rows, seconds)

    def record_propose(self, k: int, seconds: float) -> bool:
        """`propose` with a bound of k drafts took `seconds`; False when the call was cold (discarded)."""
        self._propose_calls += 1
        if self._propose_calls <= COLD_PROPOSE_CALLS and (
                not self._forward_s or seconds <= COLD_SLACK * self.forward_s(1)):
            return False
        self._propose_s.record(k, seconds)
        return True

    def record_acceptance(self, num_drafted: int, num_accepted: int) -> None:
        """A verify of any request of this engine judged its drafts (Acceptance.record's rule)."""
        if num_drafted:
            self._passed = DRAFTER_DECAY * self._passed + num_accepted
            self._judged = DRAFTER_DECAY * self._judged + num_accepted + (num_accepted < num_drafted)

    @property
    def drafter_alpha(self) -> float | None:
        """The drafter's per-draft acceptance over this engine's requests (recent ones weigh
        most), the prior of a new request; None before DRAFTER_MIN_JUDGED drafts were judged."""
        return self._passed / self._judged if self._judged >= DRAFTER_MIN_JUDGED else None

    def record_upkeep(self, num_rows: int, seconds: float) -> None:
        """The drafter's work outside propose for `num_rows` committed rows took `seconds`."""
        if num_rows >= 1 and seconds >= 0:
            self._upkeep_s_per_row = _ema(self._upkeep_s_per_row, seconds / num_rows)

    # -- the model ------------------------------------------------------------------------------

    def forward_s(self, num_rows: int) -> float:
        """Seconds of a forward of `num_rows` rows; before anything is measured, the prior line
        1 + PRIOR_ROW_COST · (n - 1) in units of one row."""
        if not self._forward_s:
            return 1.0 + PRIOR_ROW_COST * (num_rows - 1)
        return self._scale * self._forward_s(num_rows)

    def propose_s(self, k: int) -> float:
        """Seconds of `propose` bounded at k drafts (0 for k = 0, and before any warm call)."""
        if k == 0 or not self._propose_s:
            return 0.0
        return self._propose_s(k)

    @property
    def upkeep_s_per_row(self) -> float:
        return self._upkeep_s_per_row or 0.0

    def plan(self, alphas: list[float], limits: list[int], num_other_rows: int = 0,
             survivals: list[list[float] | None] | None = None) -> list[int]:
        """k_i for each decoding request: alphas[i] its α, limits[i] its bound (0: it cannot draft),
        num_other_rows the step's prefill rows; survivals[i], when given and not None, request i's
        proposed drafts' survivals (`Calibration.survivals`, at most limits[i] of them), its slots in
        place of α_i^j, its propose already paid. The rule is the module docstring's."""
        if not self.adaptive:
            return [lim if survivals is None or survivals[i] is None else min(lim, len(survivals[i]))
                    for i, lim in enumerate(limits)]
        scored = [None] * len(alphas) if survivals is None else survivals
        slots = sorted(((alphas[i] ** j if scored[i] is None else scored[i][j - 1], i) for i, lim in enumerate(limits)
                        if alphas[i] > 0 or scored[i] is not None
                        for j in range(1, (lim if scored[i] is None else min(lim, len(scored[i]))) + 1)),
                       key=lambda s: -s[0])  # stable: a request's slots keep their order on ties
        rows = len(alphas) + num_other_rows
        forward = [self.forward_s(rows + b) for b in range(len(slots) + 1)]  # by slots admitted
        propose = [self.propose_s(k) for k in range(max(limits, default=0) + 1)]
        upkeep = self.upkeep_s_per_row
        ks = [0] * len(alphas)
        tokens, drafting = float(len(alphas)), 0.0  # value(ks) = tokens / (forward + drafting), kept as slots join
        best_ks, best = list(ks), PLAN_MARGIN * tokens / forward[0]  # drafting must beat plain by the margin
        for b, (survival, i) in enumerate(slots, start=1):
            k = ks[i]
            # a request's first slot adds its propose call (unless paid) and its correction row's upkeep
            paid = scored[i] is not None
            drafting += (0.0 if paid else propose[k + 1] - propose[k]) + upkeep * (survival + (k == 0))
            tokens += survival
            ks[i] = k + 1
            value = tokens / (forward[b] + drafting)
            if value > best:
                best_ks, best = list(ks), value
        return best_ks

    def value(self, alphas: list[float], ks: list[int], num_other_rows: int = 0) -> float:
        """Expected emitted tokens per second of a step that verifies ks[i] drafts for request i."""
        tokens, seconds = float(len(alphas)), self.forward_s(len(alphas) + num_other_rows + sum(ks))
        for alpha, k in zip(alphas, ks):
            if k:
                accepted = expected_accepted(alpha, k)
                tokens += accepted
                seconds += self.propose_s(k) + self.upkeep_s_per_row * (1 + accepted)
        return tokens / seconds if seconds > 0 else float("inf")

    def summary(self) -> dict:
        """What was measured, in ms: forward by rows, propose by k, upkeep per committed row."""
        return {"forward_ms": {n: round(1e3 * self.forward_s(n), 3) for n in sorted(self._forward_s.means)},
                "propose_ms": {k: round(1e3 * s, 3) for k, s in sorted(self._propose_s.means.items())},
                "upkeep_ms_per_row": round(1e3 * self.upkeep_s_per_row, 4)}

    def why_plain(self, alpha: float, limit: int) -> str:
        """One line naming the costs that made a request's best k 0 (for its reason)."""
        k = max(1, min(limit, self.max_draft_tokens))
        e = 1 + expected_accepted(alpha, k)
        spec_ms = 1e3 * (self.propose_s(k) + self.forward_s(k + 1) + self.upkeep_s_per_row * e)
        plain_ms = 1e3 * self.forward_s(1)
        return (f"draft {1e3 * self.propose_s(k):.1f} ms + verify {1e3 * self.forward_s(k + 1):.1f} ms + upkeep "
                f"{1e3 * self.upkeep_s_per_row * e:.1f} ms for {e:.2f} expected tokens (α={alpha:.2f}, K={k}) "
                f"= {spec_ms / e:.1f} ms/token >= {plain_ms:.1f} ms/token plain")
