"""SpeculativeExecution: the one implementation of draft → verify → accept → rollback → commit.

One step, with the pending token `last` at position p (emitted, not yet in the cache), in two
halves around the caller's forward (the scheduler's, beside other sequences, or `step`'s alone):

1. `next_segment(k)`: k = 0 is the plain path: the segment [last], no speculator call. Else
   the speculator catches up on what it has not seen (its deferred commits, then `prepare`)
   and `Speculator.propose` gives d1..dk' (k' <= k) for positions p+1..; the segment is
   [last, d1..dk'] as one verify (rows' logits for positions p+1+i).
2. `take(out)`: the caller's sampler draws row 0, 1, ... in order; a draft is accepted while
   the drawn token equals it. The first mismatching draw is the *correction*; when every draft
   passes, row k's draw is the *bonus*. Every drawn token is emitted, so the output is what
   plain decoding draws (Leviathan et al. 2023, arXiv 2211.17192, with a deterministic drafter
   and draws keyed by position). Then `trunk.keep(seq, a + 1)` undoes the rest, whatever the
   trunk's state kinds, and the kept tokens [last, d1..da] are committed to the speculator.

Who picks k: `draft_limit` says how many drafts the sequence allows (0 with a cause when it
cannot draft); the scheduler's plan (verispec.cost_model) picks k within it. A step `step` runs
alone asks the governor first (`solo_plan`). A speculator that scores its drafts
(SpeculatorSpec.scores_drafts) is asked first, at the limit (`draft_ahead`): the plan weighs the
proposal's calibrated probabilities, and `next_segment(k)` verifies its first k ids (k = 0, or
no proposal: a plain step for "budget").

Upkeep is deferred while it can be: a speculator that needs no hidden rows sees committed
tokens only when it next drafts (one `commit` of everything since its last one), so plain steps
cost it nothing, and it is armed at its first draft over all the sequence holds. A speculator
that reads hidden rows follows every forward (its rows exist only then). Time in `commit` and
`prepare` is the drafter's upkeep (CostModel.record_upkeep), `propose` its drafting.

A stop (stop token, stop string, max_tokens; decided by the caller's `on_token`) inside an
accepted window ends the step at that token: rows past it count as rejected, and the cache
keeps exactly what a plain run would hold. A window never starts at a stop token.
"""
from __future__ import annotations

import enum
import logging
import numbers
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from verispec.cost_model import PROBE_MAX_DRAFTS, Acceptance
from verispec.plugin_calls import PluginTimeout
from verispec.sampling import InvalidLogits
from verispec.step_stats import ExecutionStats, StepRecord
from verispec.seams import DraftContext, Proposal, Segment, Trunk, Speculator, UnsupportedTap, declared

if TYPE_CHECKING:
    from verispec.sampling import Draw

log = logging.getLogger("verispec")

#: the --spec-draft default (docs/design.md §5).
DEFAULT_MAX_DRAFT_TOKENS = 8

#: on_token(draw) -> True to stop generation at draw.token (it is still emitted).
#: draw is a verispec.sampling.Draw: the token and, when asked for, its logprobs.
OnToken = Callable[["Draw"], bool]  # noqa: F821 (Draw is imported for type checking only)


def resolve_max_draft_tokens(explicit: int | None, trunk: object) -> int:
    """The K ceiling: an explicit --spec-draft (validated by SpecOptions: 1..MAX_DRAFT_TOKENS) wins;
    else the default narrowed by the trunk's preference."""
    if explicit is not None:
        return explicit
    preferred = declared(trunk, "spec_preferred_max_draft_tokens")
    return min(DEFAULT_MAX_DRAFT_TOKENS, preferred) if preferred else DEFAULT_MAX_DRAFT_TOKENS


class Arming(enum.Enum):
    """Where an execution's speculator stands for its sequence."""

    ARMED = "armed"  # drafts when asked, and sees every commit (deferred while it can be)
    UNARMED = "unarmed"  # cannot join a sequence that starts from a reused prefix: plain for it
    DETACHED = "detached"  # the engine switched it off or replaced it: plain from now on
    FAULTED = "faulted"  # it raised or returned junk: switched off for this sequence


class SpeculativeExecution:
    """Runs one sequence `seq` of a trunk, speculating with `speculator` while it is armed.

    sampler: `.draw(logits fp32 [V], pos) -> Draw` and `.accept(token)` (verispec.sampling.Sampler).
    governor: optional SpeculationCostGovernor; it times the steps `step`/`next_segment(timed=True)`
      run alone (`should_speculate`, `plain_cause`, `record_*`). None = always armed.
    cost_model: optional verispec.cost_model.CostModel; it picks k for `step` and hears the
      drafter's propose and upkeep timings. None = k is the whole draft limit.
    max_draft_tokens: the K ceiling (--spec-draft), within the speculator's own; default the speculator's.
    on_plugin_fault: called once with a one-line reason when the speculator faults (module
      docstring); default: a logged warning naming the speculator.
    plugin_calls: runs each speculator call, `plugin_calls(fn, *args)` (verispec.plugin_calls:
      on a worker thread, abandoned past a bound); None calls them directly.
    steps: a list that receives a StepRecord per step (it becomes `stats.steps`); None records none.
    """

    def __init__(self, trunk: Trunk, seq: int, speculator: Speculator | None, *,
                 stop_token_ids: Sequence[int] = (), governor=None, cost_model=None,
                 max_draft_tokens: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 on_plugin_fault: Callable[[str], None] | None = None, plugin_calls: Callable | None = None,
                 steps: list | None = None):
        self.trunk, self.seq = trunk, seq
        self.speculator = speculator
        self.stop_token_ids = frozenset(stop_token_ids)
        self.governor, self.cost_model, self.clock = governor, cost_model, clock
        self.plugin_calls = plugin_calls
        ceiling = speculator.max_draft_tokens if speculator is not None else 0
        self.max_draft_tokens = min(max_draft_tokens, ceiling) if max_draft_tokens else ceiling
        self.stats = ExecutionStats(steps=steps)
        self.acceptance = Acceptance(cost_model.drafter_alpha if cost_model is not None else None)
        self.last_token: int | None = None
        self.arming = Arming.ARMED if speculator is not None else None
        #: why the speculator was switched off for this sequence, or None.
        self.fault: str | None = None
        self._on_plugin_fault = on_plugin_fault or (
            lambda reason: log.warning("%s; switched off for this sequence, decoding plainly", reason))
        #: a hidden-free speculator sees commits only when it drafts: its state is made then
        self._deferred = speculator is not None and not speculator.spec.needs_hidden_state
        self._unseen: list[int] = []  # committed tokens the (deferred) speculator has not seen yet
        self._num_seen = 0  # positions the speculator has seen
        self._upkeep_rows, self._upkeep_s = 0, 0.0  # committed rows and upkeep seconds not yet reported
        self._hidden_prev = None
        self._view = trunk.view() if speculator is not None else None
        self._state = None
        if speculator is not None and not self._deferred:
            self._state = self._plugin_call("new_state", speculator.new_state)
            self._check_taps()
        self._step: _Step | None = None  # the step between next_segment and take
        # the base class's prepare and keep do nothing: a speculator that keeps them is not called for them
        self._calls_prepare = speculator is not None and _overrides(speculator, "prepare")
        self._calls_keep = speculator is not None and _overrides(speculator, "keep")

    @property
    def seq_len(self) -> int:
        """Committed positions of the sequence (the pending token is not among them)."""
        return self.trunk.seq_len(self.seq)

    @property
    def armed(self) -> bool:
        return self.arming is Arming.ARMED

    @property
    def _needs_hidden(self) -> bool:
        return self.armed and self.speculator.spec.needs_hidden_state

    def segment(self, tokens: Sequence[int], *, logits: str = "last", verify: bool = False) -> Segment:
        """The segment appending `tokens` to this sequence; it asks for hidden rows while the speculator needs them."""
        hidden = self._needs_hidden
        return Segment(self.seq, list(tokens), logits=logits, hidden=hidden,
                       tap_layers=self.speculator.tap_layers if hidden else None, verify=verify)

    def _check_taps(self) -> None:
        """Refuse, before any forward, hidden taps the trunk cannot serve: the drafter's fault."""
        try:
            self._view.tap_feature_size(self.speculator.tap_layers)
        except UnsupportedTap as exc:
            self._plugin_fault(f"asked for hidden taps the trunk cannot serve ({exc})")

    # -- plugin faults -----------------------------------------------------------------

    def _plugin_call(self, what: str, call: Callable, *args):
        """`call(*args)` (through plugin_calls when given), or None after switching the speculator off
        when it raises — SystemExit included: a plugin never ends the process — or runs past the
        plugin_calls wait (abandoned: its bound, or a request's time limit)."""
        try:
            return self.plugin_calls(call, *args) if self.plugin_calls is not None else call(*args)
        except PluginTimeout as exc:
            self._plugin_fault(f"{what} {exc.rule}; abandoned")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- anything a plugin raises is its fault
            self._plugin_fault(f"{what} raised {type(exc).__name__}: {exc}")
        return None

    def _plugin_fault(self, what: str) -> None:
        if self.fault is not None:
            return
        self.arming = Arming.FAULTED
        self.fault = f"speculator {self.speculator.name!r}: {what}"
        self._on_plugin_fault(self.fault)

    def _checked_draft(self, draft, k: int) -> list[int]:
        """The proposal as a list of ints, or [] after switching the speculator off for junk."""
        if self.fault is not None:  # propose itself raised
            return []
        if not isinstance(draft, (list, tuple)):
            self._plugin_fault(f"propose returned {type(draft).__name__}, not a list of token ids")
            return []
        if len(draft) > k:
            self._plugin_fault(f"propose returned {len(draft)} ids for a bound of {k}")
            return []
        vocab = self.trunk.vocab_size
        bad = [t for t in draft if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            self._plugin_fault(f"propose returned {bad[0]!r}, not a token id in [0, {vocab})")
            return []
        return [int(t) for t in draft]

    # -- sequence set-up ---------------------------------------------------------------

    def take_prefill(self, tokens: Sequence[int], out) -> None:
        """This sequence's output (a SegmentOutput) of a forward of `segment(tokens)`, run by the
        caller beside other sequences: commit the prompt tokens to the speculator."""
        self._commit(tokens, out.hidden, self.seq_len - len(tokens))

    def emit_first(self, sampler, logits, on_token: OnToken) -> bool:
        """Draw the first new token from the prompt's last row (logits fp32 [V]); returns True when it said stop."""
        token, stop = self._emit(sampler, logits, self.seq_len, on_token)
        self.last_token = token
        return stop

    def seed_committed(self, tokens: Sequence[int]) -> None:
        """The sequence starts from a reused prefix holding `tokens` (positions 0..len-1), before
        any forward of it: a speculator that can arm after prefix reuse sees them; others stay
        plain for this sequence."""
        if not self.armed:
            return
        if not self.speculator.spec.can_arm_after_prefix_reuse:
            self.arming = Arming.UNARMED  # it cannot see the reused rows
            return
        self._commit(tokens, None, 0)

    def detach(self) -> None:
        """Stop drafting for, and reporting to, the speculator (it was replaced or switched off)."""
        if self.armed:
            self.arming = Arming.DETACHED

    # -- one step ------------------------------------------------------------------------

    def draft_limit(self, tokens_left: int | None = None) -> tuple[int, str | None]:
        """The most drafts this step may verify and None, or (0, why not): not armed, a pending
        stop token, or no room (verispec.reasons.PLAIN_CAUSES). tokens_left: tokens the request
        may still emit (a step emits at most k + 1), None = unbounded."""
        if not self.armed:
            return 0, self.arming.value if self.arming is not None else "unarmed"
        if self.last_token in self.stop_token_ids:
            return 0, "stop_token"
        room = self.trunk.max_context_length - self.seq_len - 1  # verify writes k + 1 rows
        k = min(self.max_draft_tokens, room, tokens_left - 1 if tokens_left is not None else room)
        if (self.cost_model is not None and self.cost_model.adaptive and not self.acceptance.measured
                and not self.speculator.spec.scores_drafts):
            k = min(k, PROBE_MAX_DRAFTS)  # measured cheaply first (verispec.cost_model)
        return (k, None) if k >= 1 else (0, "too_short")

    def solo_plan(self, tokens_left: int | None = None) -> tuple[int, str | None]:
        """k for a step of this sequence alone: the draft limit, the governor's verdict, then the
        cost model's choice (0 with "budget" when drafting does not pay at this acceptance)."""
        k, cause = self.draft_limit(tokens_left)
        if k == 0:
            return 0, cause
        if self.governor is not None and not self.governor.should_speculate():
            return 0, self.governor.plain_cause()
        if self.cost_model is not None:
            survivals = self.draft_ahead(k, timed=True)
            k = self.cost_model.plan([self.acceptance.planning_alpha], [k], survivals=[survivals])[0]
            if k == 0:
                return 0, "budget"
        return k, None

    def draft_ahead(self, k: int, *, timed: bool = False) -> list[float] | None:
        """For a speculator that scores its drafts: propose now, at most k ids (the draft limit,
        >= 1), and return the proposal's survivals for the plan (CostModel.calibration.survivals:
        the chance that drafts 1..j all pass; [] for no draft); `next_segment` then verifies its
        first ids. None for any other speculator (it proposes in `next_segment`, k as planned)."""
        if self.cost_model is None or not self.speculator.spec.scores_drafts:
            return None
        self._propose(k, timed)
        self._step.ahead = True
        if not self.cost_model.adaptive:  # forced drafting (--spec-adaptive off): the whole proposal
            return [1.0] * len(self._step.probs)
        return self.cost_model.calibration.survivals(self._step.probs)

    def step(self, sampler, on_token: OnToken) -> bool:
        """One step of this sequence alone (solo_plan, next_segment, the trunk's forward, take):
        emits one or more tokens through `on_token`, in order; returns True when it said stop."""
        k, cause = self.solo_plan()
        segment = self.next_segment(k, cause, timed=True)
        start = self.clock()
        out = self.trunk.forward([segment])[0]
        if self.cost_model is not None:
            self.cost_model.record_forward(len(segment.tokens), self.clock() - start)
        return self.take(out, sampler, on_token)

    def next_segment(self, k: int, cause: str | None = None, *, timed: bool = False) -> Segment:
        """The rows this sequence forwards this step: [last] when k = 0 (a plain step, for `cause`),
        else [last, d1..dk'] with the speculator's draft (k' <= k; an empty draft is a no-draft
        step). timed: the governor times this step (it runs alone). After `draft_ahead`: the
        proposal's first k ids, no new propose. Hand the forward's output for this segment to `take`."""
        ahead = self._step if self._step is not None and self._step.ahead else None
        if ahead is not None:
            if k > 0 and ahead.draft:
                del ahead.draft[k:], ahead.probs[k:]
                return self.segment([self.last_token, *ahead.draft], logits="all", verify=True)
            k, cause, timed = 0, cause or "budget", ahead.timed
        if k == 0:
            self._begin(0, cause, timed)
            if cause == "budget" and self.cost_model is not None:
                self.stats.budget_line = self._budget_line(ahead)
            if not self._deferred:
                self._report_upkeep()
            return self.segment([self.last_token])
        return self._propose(k, timed)

    def _propose(self, k: int, timed: bool) -> Segment:
        """begin_draft, the speculator's `propose` (timed as drafting), end_draft: the step's segment."""
        ctx = self.begin_draft(k, timed=timed)
        started = self.clock()
        proposed = None if ctx is None else self._plugin_call("propose", self.speculator.propose, self._state, ctx)
        return self.end_draft(proposed, self.clock() - started)

    def _budget_line(self, ahead: "_Step | None") -> str:
        """Why the cost model gave this step no draft: its costs at the request's acceptance, or at
        the calibrated probability of a proposal made ahead (`draft_ahead`)."""
        if ahead is None:
            return self.cost_model.why_plain(self.acceptance.planning_alpha, self.draft_limit()[0])
        if not ahead.draft:
            return "the speculator proposed no draft"
        return self.cost_model.why_plain(self.cost_model.calibration.alpha(ahead.probs[0]), len(ahead.draft))

    def begin_draft(self, k: int, *, timed: bool = False) -> DraftContext | None:
        """The first half of a drafting step (k >= 1): the speculator catches up (deferred commits,
        `prepare`, timed as upkeep); returns the step's DraftContext for `propose`, or None when
        the speculator faulted on the way. Then `end_draft` with what it proposed."""
        self._begin(k, None, timed)
        self._catch_up()
        ctx = DraftContext(last_token=self.last_token, pos=self.seq_len, max_draft_tokens=k,
                           min_draft_prob=self.speculator.min_draft_prob, hidden_prev=self._hidden_prev,
                           stop_token_ids=self.stop_token_ids, seq=self.seq, trunk=self._view)
        if self.fault is None and self._calls_prepare:
            started = self.clock()
            self._plugin_call("prepare", self.speculator.prepare, self._state, ctx)
            self._upkeep_s += self.clock() - started
        self._report_upkeep()
        return ctx if self.fault is None else None

    def end_draft(self, proposed, draft_s: float) -> Segment:
        """The second half: `proposed` (propose's return for this step's context; None after a
        fault) took `draft_s` seconds of drafting; returns the segment to forward."""
        step = self._step
        step.draft_s = draft_s
        self.stats.draft_s += draft_s
        step.warm = self.cost_model.record_propose(step.k, draft_s) if self.cost_model is not None else True
        step.draft = self._checked_draft(proposed, step.k)
        if step.draft and self.speculator.spec.scores_drafts:
            if isinstance(proposed, Proposal):
                step.probs = list(proposed.probs)
            else:
                self._plugin_fault(f"propose returned a {type(proposed).__name__}, not a Proposal with each draft's "
                                   "probability, though its spec declares scores_drafts")
                step.draft = []
        if not step.draft:
            return self.segment([self.last_token])
        return self.segment([self.last_token, *step.draft], logits="all", verify=True)

    def _begin(self, k: int, cause: str | None, timed: bool) -> None:
        if self.last_token is None:
            raise RuntimeError("a step before the first token: prefill, sample it, and set last_token")
        self._step = _Step(start=self.clock(), timed=timed and self.governor is not None, cause=cause, k=k)

    def take(self, out, sampler, on_token: OnToken) -> bool:
        """This sequence's output (a SegmentOutput) of the forward of `next_segment`'s segment: accept,
        keep, commit and emit. Returns True when on_token said stop."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("take() without next_segment()")
        if step.draft:
            return self._take_verify(step, out, sampler, on_token)
        stop = self._take_decode(out, sampler, on_token)
        elapsed = self.clock() - step.start
        if step.cause is None:  # asked to draft, drafted nothing: a speculative sample of one token (rule 4)
            self.stats.num_no_draft_steps += 1
            self._record_step("no_draft", 0, 0, 1)
            if step.timed and step.warm:
                self.governor.record_spec_step(elapsed, num_emitted=1, num_accepted=0, num_drafted=0,
                                               draft_s=step.draft_s)
            return stop
        self._record_step(step.cause, 0, 0, 1)
        self.stats.num_plain_steps += 1
        self.stats.plain_steps[step.cause] += 1
        if step.cause == "budget":
            self.acceptance.skip()  # a request the model said not to draft for is measured again later
        if step.timed:
            self.governor.record_plain_step(elapsed, num_emitted=1)
        return stop

    def _take_decode(self, out, sampler, on_token: OnToken) -> bool:
        base, last = self.seq_len - 1, self.last_token
        self._commit([last], out.hidden, base)
        token, stop = self._emit(sampler, out.logits[-1], base + 1, on_token)
        self.last_token = token
        return stop

    def _take_verify(self, step: _Step, out, sampler, on_token: OnToken) -> bool:
        draft = step.draft
        rows = [self.last_token, *draft]
        base = self.seq_len - len(rows)
        i = num_accepted = 0
        while True:
            token, stop = self._emit(sampler, out.logits[i], base + 1 + i, on_token)
            matched = i < len(draft) and token == draft[i]
            num_accepted += matched
            if stop or not matched:
                break
            i += 1
        num_kept = i + 1  # [last, d1..di] stay in the sequence; `token` is the new pending token
        self.trunk.keep(self.seq, num_kept)
        if self._calls_keep:
            self._plugin_call("keep", self.speculator.keep, self._state, num_kept)
        self._commit(rows[:num_kept], None if out.hidden is None else out.hidden[:num_kept], base)
        self.last_token = token
        self._record_step("spec", len(draft), num_accepted, num_kept)
        stats = self.stats
        stats.num_spec_steps += 1
        stats.num_draft_tokens += len(draft)
        stats.num_accepted_tokens += num_accepted
        if len(stats.num_accepted_tokens_per_pos) < len(draft):
            stats.num_accepted_tokens_per_pos.extend([0] * (len(draft) - len(stats.num_accepted_tokens_per_pos)))
        for j in range(num_accepted):
            stats.num_accepted_tokens_per_pos[j] += 1
        self.acceptance.record(len(draft), num_accepted)
        if self.cost_model is not None:
            self.cost_model.record_acceptance(len(draft), num_accepted)
            if step.probs:
                self.cost_model.calibration.record(step.probs, num_accepted)
        if step.timed and step.warm:
            self.governor.record_spec_step(self.clock() - step.start, num_emitted=num_kept,
                                           num_accepted=num_accepted, num_drafted=len(draft), draft_s=step.draft_s)
        return stop

    def _record_step(self, kind: str, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Append a StepRecord when asked for."""
        if self.stats.steps is not None:
            self.stats.steps.append(StepRecord(kind, num_drafted, num_accepted, num_emitted))

    def _emit(self, sampler, logits_row, pos: int, on_token: OnToken) -> tuple[int, bool]:
        try:
            draw = sampler.draw(logits_row, pos)
        except InvalidLogits:
            check_weights = declared(self.trunk, "check_weights")
            if check_weights is not None:
                check_weights()  # a damaged file is the user's to fix (DamagedFile naming the tensor)
            raise
        sampler.accept(draw.token)
        self.stats.num_emitted_tokens += 1
        return draw.token, bool(on_token(draw))

    # -- the speculator's view of the sequence -----------------------------------------------

    def _commit(self, tokens: Sequence[int], hidden_rows, start_pos: int) -> None:
        """Tokens that landed at start_pos..: to the speculator now, or (deferred) at its next draft."""
        if hidden_rows is not None:
            self._hidden_prev = hidden_rows[-1]
        if not self.armed:
            return
        self._upkeep_rows += len(tokens)
        if self._deferred:
            self._unseen.extend(int(t) for t in tokens)
            return
        self._send(tokens, hidden_rows, start_pos)

    def _catch_up(self) -> None:
        """Before a draft: a deferred speculator gets its state (at its first draft) and one commit
        of every token since its last one."""
        if not self._deferred or self.fault is not None:
            return
        if self._state is None:
            self._state = self._plugin_call("new_state", self.speculator.new_state)
        if self._unseen and self.fault is None:
            tokens, self._unseen = self._unseen, []
            self._send(tokens, None, self._num_seen)

    def _send(self, tokens: Sequence[int], hidden_rows, start_pos: int) -> None:
        started = self.clock()
        self._plugin_call("commit", self.speculator.commit, self._state, list(tokens), hidden_rows, start_pos)
        self._num_seen = start_pos + len(tokens)
        self._upkeep_s += self.clock() - started

    def _report_upkeep(self) -> None:
        """The drafter's upkeep (commit, prepare) since the last report, per committed row, to the cost model."""
        if self.cost_model is not None and self._upkeep_rows > 0:
            self.cost_model.record_upkeep(self._upkeep_rows, self._upkeep_s)
        self._upkeep_rows, self._upkeep_s = 0, 0.0


def _overrides(speculator: Speculator, name: str) -> bool:
    """The speculator's `name` (its class's, or set on the instance) is not the base class's."""
    method = getattr(speculator, name)
    return getattr(method, "__func__", method) is not getattr(Speculator, name)


def draft_segments(executions: Sequence[SpeculativeExecution], plans: Sequence[tuple[int, str | None]], *,
                   timed: bool = False) -> list[Segment]:
    """`next_segment` for several sequences of one step, plans[i] = (k, plain cause): the ones that
    draft propose in one `Speculator.propose_batch` call per speculator (a drafter that forwards
    a model runs one forward per draft position over all of them), each charged an equal share
    of its time. A raise or a wrong-length answer is every caller's plugin fault."""
    segments: list[Segment | None] = [None] * len(executions)
    groups: dict[int, list] = {}
    for i, (ex, (k, cause)) in enumerate(zip(executions, plans)):
        if k == 0 or (ex._step is not None and ex._step.ahead):  # plain, or proposed already (draft_ahead)
            segments[i] = ex.next_segment(k, cause, timed=timed)
            continue
        ctx = ex.begin_draft(k, timed=timed)
        if ctx is None:
            segments[i] = ex.end_draft(None, 0.0)
        else:
            groups.setdefault(id(ex.speculator), []).append((i, ex, ctx))
    for group in groups.values():
        speculator, clock = group[0][1].speculator, group[0][1].clock
        started = clock()
        what = "propose" if type(speculator).propose_batch is Speculator.propose_batch else "propose_batch"
        runner = group[0][1].plugin_calls
        try:
            states, ctxs = [ex._state for _, ex, _ in group], [ctx for _, _, ctx in group]
            proposals = runner(speculator.propose_batch, states, ctxs) if runner is not None \
                else speculator.propose_batch(states, ctxs)
            if not isinstance(proposals, (list, tuple)) or len(proposals) != len(group):
                raise TypeError(f"returned {type(proposals).__name__} for {len(group)} contexts, not one list each")
        except PluginTimeout as exc:
            for _, ex, _ in group:
                ex._plugin_fault(f"{what} {exc.rule}; abandoned")
            proposals = [None] * len(group)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- anything a plugin raises is its fault
            for _, ex, _ in group:
                ex._plugin_fault(f"{what} raised {type(exc).__name__}: {exc}")
            proposals = [None] * len(group)
        share = (clock() - started) / len(group)
        for (i, ex, _), proposed in zip(group, proposals):
            segments[i] = ex.end_draft(proposed, share)
    return segments


@attrs.define
class _Step:
    """What `next_segment` decided, for `take`."""

    start: float
    timed: bool
    cause: str | None  # why the step is plain; None when the speculator is asked to draft
    k: int = 0
    draft: list[int] = attrs.field(factory=list)
    draft_s: float = 0.0
    warm: bool = True  # the propose timing counts (not a cold first call)
    probs: list[float] = attrs.field(factory=list)  # a scored draft's probabilities (Proposal.probs)
    ahead: bool = False  # proposed before the plan (draft_ahead)
