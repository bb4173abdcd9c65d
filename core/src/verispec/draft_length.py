"""DraftLengthPolicy: how many drafts K the next speculative step verifies, within [0, max_draft_tokens].

The governor decides *whether* to speculate; the draft-length policy decides *how far*. It picks the K
that maximises expected emitted tokens per unit of step time:

    K* = argmax over 1 <= K <= max_draft_tokens of  E(K) / cost(K + 1)     (ties: the smaller K)

and, under `--spec-adaptive on` (`allow_zero`), K = 0 (no draft: the step decodes plainly, and
the governor hears of a step that drafted nothing) once costs are measured, this request's own
drafts have been judged (at least MIN_OWN_JUDGED of recent evidence, so the prior alone never
stops a request from drafting), and even K* expects no more than the one token a plain row
gives in that time: E(K*) / cost(K* + 1) <= 1. That is drafting that does not pay at the
acceptance this text shows: a drafter as slow as a small model on a machine whose verify rows
are compute-bound. A K = 0 step (`skip`) lets the acceptance evidence decay toward the prior
and the request's own evidence fade, so after a few such steps the request drafts again and a
text that changes is measured again.

E(K) — expected tokens emitted by a step that verifies K drafts, when each draft is accepted
with probability α independently of the others (Leviathan et al. 2023, arXiv 2211.17192,
eq. 1), counting the correction or bonus token:
    E(K) = 1 + α + … + α^K = (1 − α^(K+1)) / (1 − α)

α — the per-draft acceptance rate, estimated from accepted prefixes. A step that accepts a of
K drafts judged a + 1 drafts when a < K (a passes, then one rejection; the drafts after it were
never judged) and K drafts when a = K. So α = Σ passes / Σ judged: the maximum-likelihood
estimate of a geometric run truncated at K (a/K would be biased low). Both sums decay by
ACCEPT_DECAY per step, so the policy follows the text, and start from a prior of
PRIOR_JUDGED drafts at PRIOR_ACCEPT_RATE.

cost(n) — a speculative step with n = K + 1 verify rows, in units of one plain decode row
(`set_plain_row_s`). It is not a line: on this CPU (docs/reference/baselines.md §5) an int8 verify
costs 0.99x at 2 rows, 1.22x at 4, 2.28x at 8, 4.39x at 16 — memory-bound up to ~4 rows, then
compute-bound (a roofline knee) — while fp32 is concave (1.77x at 2, 2.56x at 16). No single
per-row cost fits both, so the policy keeps what it measured, per row count:
  - n measured: the running mean (COST_EMA_WEIGHT) of its step seconds / plain row seconds;
  - n between two measured counts: linear interpolation (n = 1 costs 1 by definition);
  - n beyond the largest measured count m: cost(m) + prior_row_cost · (n − m). This is
    optimistic on purpose (the memory-bound slope: int8 1 → 4 rows is 0.07/row), so a longer
    length is tried once when acceptance makes it worth it, and is then measured.
Until a plain row time is known every cost is the prior line 1 + prior_row_cost · (n − 1).
The measured step time includes drafting and rollback, so E/cost is tokens per second; for a
draft model that is K drafter forwards plus the (K+1)-row verify, both models priced together.
"""
from __future__ import annotations

#: weight kept by the acceptance evidence per step (≈ the last 5 steps count).
ACCEPT_DECAY = 0.8
#: prior acceptance rate, worth PRIOR_JUDGED judged drafts of evidence.
PRIOR_ACCEPT_RATE = 0.5
PRIOR_JUDGED = 2.0
#: judged drafts of this request's own (decayed) evidence before K = 0 may be chosen.
MIN_OWN_JUDGED = 3.0
#: weight of a new measurement in a row count's (or the plain row's) running mean of seconds.
COST_EMA_WEIGHT = 0.25


class InvalidDraftLengthRecord(ValueError):
    """A policy argument or step report that cannot be used (see the message for which)."""


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """E(K): expected emitted tokens of a step verifying `num_drafts` drafts at acceptance `alpha`."""
    return sum(alpha ** i for i in range(num_drafts + 1))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + COST_EMA_WEIGHT * (new - old)


class DraftLengthPolicy:
    """Per-step draft length K in [0, max_draft_tokens] from acceptance and measured step cost.

    max_draft_tokens: the K ceiling (--spec-draft, narrowed by the trunk), >= 1.
    prior_row_cost: cost of one more verify row relative to one plain row, assumed where
        nothing is measured (default 0.06: the memory-bound int8 slope on this CPU).
    allow_zero: `next` may answer 0 (the engine passes --spec-adaptive; off forces drafting, so
        K stays >= 1 for measurements).
    Raises InvalidDraftLengthRecord for max_draft_tokens < 1 or prior_row_cost < 0.
    """

    def __init__(self, max_draft_tokens: int, prior_row_cost: float = 0.06, *, allow_zero: bool = False):
        if max_draft_tokens < 1 or prior_row_cost < 0:
            raise InvalidDraftLengthRecord(f"DraftLengthPolicy({max_draft_tokens=}, {prior_row_cost=}): "
                                      "give max_draft_tokens >= 1 and prior_row_cost >= 0")
        self.max_draft_tokens = max_draft_tokens
        self.prior_row_cost = prior_row_cost
        self.allow_zero = allow_zero
        self._plain_row_s: float | None = None
        self._step_s: dict[int, float] = {}  # verify rows n -> running mean of step seconds
        self.reset()

    def reset(self) -> None:
        """A new request: forget the acceptance evidence. Measured costs describe the machine, not
        the text, and are kept."""
        self._passed = PRIOR_ACCEPT_RATE * PRIOR_JUDGED
        self._judged = PRIOR_JUDGED
        self._own_judged = 0.0  # the part of _judged this request's drafts contributed

    @property
    def alpha(self) -> float:
        """α, the estimated probability that one draft is accepted."""
        return self._passed / self._judged

    def set_plain_row_s(self, s: float) -> None:
        """A measured plain decode step of one row, in seconds (kept as a running mean)."""
        if s > 0:
            self._plain_row_s = _ema(self._plain_row_s, s)

    def record(self, num_drafted: int, num_accepted: int, num_rows: int, elapsed_s: float) -> None:
        """A speculative step verified `num_rows` rows (num_drafted + 1), accepted `num_accepted`
        drafts and took `elapsed_s` seconds (draft + verify + rollback).

        Raises InvalidDraftLengthRecord unless 0 <= num_accepted <= num_drafted, num_rows >= 1, elapsed_s >= 0.
        """
        if not 0 <= num_accepted <= num_drafted or num_rows < 1 or elapsed_s < 0:
            raise InvalidDraftLengthRecord(f"record({num_drafted=}, {num_accepted=}, {num_rows=}, {elapsed_s=}): "
                                      "report 0 <= accepted <= drafted, rows >= 1 and seconds >= 0")
        if num_drafted > 0:
            judged = num_accepted + (num_accepted < num_drafted)
            self._passed = ACCEPT_DECAY * self._passed + num_accepted
            self._judged = ACCEPT_DECAY * self._judged + judged
            self._own_judged = ACCEPT_DECAY * self._own_judged + judged
        if num_rows >= 2:
            self._step_s[num_rows] = _ema(self._step_s.get(num_rows), elapsed_s)

    def row_cost(self, num_rows: int) -> float:
        """cost(n): a speculative step with `num_rows` verify rows, in plain one-row steps."""
        if self._plain_row_s is None or not self._step_s:
            return 1.0 + self.prior_row_cost * (num_rows - 1)
        measured = {1: 1.0} | {n: s / self._plain_row_s for n, s in self._step_s.items()}
        if num_rows in measured:
            return measured[num_rows]
        below = max(n for n in measured if n < num_rows)
        above = [n for n in measured if n > num_rows]
        if not above:
            return measured[below] + self.prior_row_cost * (num_rows - below)
        hi = min(above)
        return measured[below] + (measured[hi] - measured[below]) * (num_rows - below) / (hi - below)

    def next(self) -> int:
        """K for the next speculative step: argmax of E(K) / cost(K + 1), the smaller K on ties; 0
        (with allow_zero) when the costs are measured, this request's drafts were judged
        (MIN_OWN_JUDGED) and that best value is at most 1 (no gain over a plain row)."""
        alpha = self.alpha
        best_k, best = 1, expected_tokens(alpha, 1) / self.row_cost(2)
        for k in range(2, self.max_draft_tokens + 1):
            value = expected_tokens(alpha, k) / self.row_cost(k + 1)
            if value > best:
                best_k, best = k, value
        measured = self._plain_row_s is not None and bool(self._step_s)
        own = self._own_judged >= MIN_OWN_JUDGED
        return 0 if self.allow_zero and measured and own and best <= 1.0 else best_k

    def skip(self) -> None:
        """A step `next` said 0 for: the acceptance evidence decays toward the prior (ACCEPT_DECAY)."""
        self._passed = ACCEPT_DECAY * self._passed + (1 - ACCEPT_DECAY) * PRIOR_ACCEPT_RATE * PRIOR_JUDGED
        self._judged = ACCEPT_DECAY * self._judged + (1 - ACCEPT_DECAY) * PRIOR_JUDGED
        self._own_judged *= ACCEPT_DECAY
