"""SpeculativeExecution: the one implementation of draft → verify → accept → rollback → commit.

One step, with the pending token `last` at position p (emitted, not yet in the cache):

1. Draft: `Speculator.prepare` (catch-up work, untimed, like a prefill), then
   `Speculator.propose` gives d1..dK for positions p+1..p+K (K from the DraftLengthPolicy;
   K = 0 is a step that drafts nothing).
2. Verify: the trunk forwards [last, d1..dK] as one batch; row i's logits are for position p+1+i.
3. Accept: the caller's sampler draws row 0, 1, ... in order; a draft is accepted while the
   drawn token equals it. The first mismatching draw is the *correction*; when every draft
   passes, row K's draw is the *bonus*. Every drawn token is emitted, so the output is what
   plain decoding draws (Leviathan et al. 2023, arXiv 2211.17192, with a deterministic
   drafter and draws keyed by position).
4. Rollback: `trunk.keep(seq, a + 1)`; the trunk undoes the rest, whatever its state kinds.
5. Commit: the kept tokens [last, d1..da] go to the speculator with their hidden rows.

A stop (stop token, stop string, max_tokens; decided by the caller's `on_token`) inside an
accepted window ends the step at that token: rows past it count as rejected, and the cache
keeps exactly what a plain run would hold. A window never starts at a stop token.
"""
from __future__ import annotations

import collections
import logging
import numbers
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from verispec.sampling import InvalidLogits
from verispec.seams import MAX_DRAFT_TOKENS, DraftContext, Segment, Trunk, Speculator, UnsupportedTap, declared

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


@attrs.define
class ExecutionStats:
    """Counters over the life of one execution (vLLM's spec-decode metric names)."""

    num_spec_steps: int = 0  # steps that verified a draft
    num_no_draft_steps: int = 0  # armed steps whose proposal was empty
    num_plain_steps: int = 0  # parked / unarmed / batched steps
    #: why plain steps were plain: cause -> steps (verispec.reasons.PLAIN_CAUSES; "batched" for a
    #: row of another forward, "detached" after the engine switched its speculator off).
    plain_steps: collections.Counter = attrs.field(factory=collections.Counter)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    #: seconds in Speculator.propose (with its DraftContext); a timing, left out of == (two runs
    #: that did the same steps are equal).
    draft_s: float = attrs.field(default=0.0, eq=False)
    #: one StepRecord per step, in order, when the caller asked for them (`steps=[]`); else None.
    steps: list[StepRecord] | None = attrs.field(default=None, eq=False)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)


@attrs.frozen
class StepRecord:
    """One step of an execution (ExecutionStats.steps): what it drafted, accepted and emitted."""

    #: "spec" (verified a draft), "no_draft" (armed, drafted nothing), or why a plain step was
    #: plain: a `plain_steps` cause ("parked", "measuring", "batched", "too_short", ...).
    kind: str
    num_drafted: int
    num_accepted: int
    num_emitted: int


def acceptance_rate(num_accepted: int, num_drafted: int) -> float:
    """Accepted draft tokens / drafted tokens (0.0 before any draft): the one definition, used by
    ExecutionStats and the server's gauge."""
    return num_accepted / num_drafted if num_drafted else 0.0


class SpeculativeExecution:
    """Runs one sequence `seq` of a trunk, speculating with `speculator` when armed.

    sampler: `.draw(logits fp32 [V], pos) -> Draw` and `.accept(token)` (verispec.sampling.Sampler).
    governor: optional SpeculationCostGovernor (`should_speculate`, `plain_cause`, `record_*`); None =
      always armed.
    window: optional DraftLengthPolicy choosing K per step within [1, its max_draft_tokens].
    on_plugin_fault: called once with a one-line reason when the speculator faults (module
      docstring); default: a logged warning naming the speculator.
    arm_late: arm a speculator that allows it (hidden-free, `can_arm_after_prefix_reuse`) later:
      `arm_pending` is then True and the caller arms it with `seed_committed` over the tokens
      the sequence holds by then, so the prefill and any batched decodes run without it. Other
      speculators are armed at once (they need the prefill's hidden rows, or every token).
    steps: a list that receives a StepRecord per step (it becomes `stats.steps`); None records none.
    """

    def __init__(self, trunk: Trunk, seq: int, speculator: Speculator | None, *,
                 stop_token_ids: Sequence[int] = (), governor=None,
                 window=None, clock: Callable[[], float] = time.perf_counter,
                 on_plugin_fault: Callable[[str], None] | None = None, arm_late: bool = False,
                 steps: list | None = None):
        self.trunk, self.seq = trunk, seq
        self.speculator = speculator
        self.stop_token_ids = frozenset(stop_token_ids)
        self.governor = governor
        self.window = window
        self.clock = clock
        self.stats = ExecutionStats(steps=steps)
        self.last_token: int | None = None
        #: waiting for `seed_committed` (arm_late); the speculator has no state for this sequence yet.
        self.arm_pending = (arm_late and speculator is not None and not speculator.spec.needs_hidden_state
                            and speculator.spec.can_arm_after_prefix_reuse)
        self._armed = speculator is not None and not self.arm_pending
        #: the speculator sees this sequence's commits (False once it declined a reused prefix).
        self._follows = self._armed
        #: why the speculator was switched off for this sequence, or None.
        self.fault: str | None = None
        #: the plain-step cause while unarmed (verispec.reasons): "unarmed" when it declined a reused prefix.
        self._unarmed_cause = "unarmed"
        self._on_plugin_fault = on_plugin_fault or (
            lambda reason: log.warning("%s; switched off for this sequence, decoding plainly", reason))
        self._hidden_prev = None
        self._view = trunk.view() if speculator is not None else None
        self._state = self._plugin_call("new_state", speculator.new_state) if self._armed else None
        if self._needs_hidden:
            self._check_taps()

    @property
    def seq_len(self) -> int:
        """Committed positions of the sequence (the pending token is not among them)."""
        return self.trunk.seq_len(self.seq)

    @property
    def _needs_hidden(self) -> bool:
        return self._armed and self.speculator.spec.needs_hidden_state

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
        """`call(*args)`, or None after switching the speculator off when it raises."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 -- any exception from a plugin is the plugin's fault
            self._plugin_fault(f"{what} raised {type(exc).__name__}: {exc}")
            return None

    def _plugin_fault(self, what: str) -> None:
        if self.fault is not None:
            return
        self._armed = self._follows = False
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
            self._plugin_fault(f"propose returned {len(draft)} ids for a window of {k}")
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
        """Arm late over tokens the sequence already holds (positions 0..len-1): a reused prefix,
        or everything held at the first speculating step (arm_late)."""
        if self.speculator is None:
            return
        self.arm_pending = False
        if not self.speculator.spec.can_arm_after_prefix_reuse:
            self._armed = self._follows = False  # stays plain for this sequence: it cannot see the reused rows
            return
        self._state = self._plugin_call("new_state", self.speculator.new_state)
        self._armed = self._follows = self.fault is None
        self._commit(tokens, None, 0)

    def detach(self) -> None:
        """Stop drafting for, and reporting to, the speculator (it was replaced or switched off)."""
        self._armed = self._follows = False
        self._unarmed_cause = "detached"

    # -- one step ------------------------------------------------------------------------

    def step(self, sampler, on_token: OnToken) -> bool:
        """Emit one or more tokens through `on_token`, in order; returns True when it said stop."""
        if self.last_token is None:
            raise RuntimeError("step() before the first token: prefill, sample it, and set last_token")
        k = self._window_size()
        if k is None:
            return self._plain_step(sampler, on_token, self._plain_cause())
        draft, draft_s = [], 0.0
        if k == 0:  # drafting does not pay at this acceptance (DraftLengthPolicy): a no-draft step
            self.window.skip()
            start = self.clock()
        else:
            ctx = DraftContext(last_token=self.last_token, pos=self.seq_len, max_draft_tokens=k,
                               min_draft_prob=self.speculator.min_draft_prob, hidden_prev=self._hidden_prev,
                               stop_token_ids=self.stop_token_ids, seq=self.seq, trunk=self._view)
            self._plugin_call("prepare", self.speculator.prepare, self._state, ctx)  # a catch-up: untimed
            start = self.clock()
            proposed = None if self.fault else self._plugin_call("propose", self.speculator.propose,
                                                                  self._state, ctx)
            draft_s = self.clock() - start  # the governor judges drafting on its own (its rule 12)
            self.stats.draft_s += draft_s
            draft = self._checked_draft(proposed, k)
        if draft:
            return self._speculative_step(draft, sampler, on_token, start, draft_s)
        self.stats.num_no_draft_steps += 1
        self._record_step("no_draft", 0, 0, 1)
        stop = self._decode_one(sampler, on_token)  # with hidden rows: a tap is a slice of rows computed anyway
        if self.governor is not None:
            self.governor.record_spec_step(self.clock() - start, num_emitted=1, num_accepted=0, num_drafted=0,
                                           draft_s=draft_s)
        return stop

    def _window_size(self) -> int | None:
        """K for this step: None for a plain step (unarmed, parked, at a stop token, or no room);
        0 when the draft-length policy says drafting does not pay; else 1..max_draft_tokens."""
        if not self._armed or self.last_token in self.stop_token_ids:
            return None
        if self.governor is not None and not self.governor.should_speculate():
            return None
        room = self.trunk.max_context_length - self.seq_len - 1  # verify writes K+1 rows
        k = min(self.speculator.max_draft_tokens, room)  # the speculator's cap: --spec-draft, or its own
        if k < 1:
            return None
        return min(k, self.window.next()) if self.window is not None else k

    def _plain_cause(self) -> str:
        """Why `_window_size` said plain (verispec.reasons.PLAIN_CAUSES, or "detached")."""
        if not self._armed:
            return self._unarmed_cause
        if self.last_token in self.stop_token_ids:
            return "stop_token"
        if self.governor is not None and not self.governor.should_speculate():
            return self.governor.plain_cause()
        return "too_short"  # no room in the context for a draft

    def _plain_step(self, sampler, on_token: OnToken, cause: str) -> bool:
        start = self.clock()
        stop = self._decode_one(sampler, on_token)  # parked: the head still sees every row
        self._record_step(cause, 0, 0, 1)
        if self.governor is not None:
            self.governor.record_plain_step(self.clock() - start, num_emitted=1)
        if self.window is not None and self.governor is not None and self.governor.stats.plain_ms_per_token:
            self.window.set_plain_row_s(self.governor.stats.plain_ms_per_token / 1e3)
        self.stats.num_plain_steps += 1
        self.stats.plain_steps[cause] += 1
        return stop

    def _decode_one(self, sampler, on_token: OnToken) -> bool:
        return self._take_decode(self.trunk.forward([self.decode_segment()])[0], sampler, on_token)

    def decode_segment(self) -> Segment:
        """The one-row segment of a plain decode of the pending token."""
        return self.segment([self.last_token])

    def take_decode(self, out, sampler, on_token: OnToken) -> bool:
        """This sequence's output (a SegmentOutput) of `decode_segment()` forwarded by the caller beside
        other sequences: a plain step the governor never times (a batched row is not the model's own
        decode). Returns True when on_token said stop."""
        self._record_step("batched", 0, 0, 1)
        self.stats.num_plain_steps += 1
        self.stats.plain_steps["batched"] += 1
        return self._take_decode(out, sampler, on_token)

    def _take_decode(self, out, sampler, on_token: OnToken) -> bool:
        base, last = self.seq_len - 1, self.last_token
        self._commit([last], out.hidden, base)
        token, stop = self._emit(sampler, out.logits[-1], base + 1, on_token)
        self.last_token = token
        return stop

    def _speculative_step(self, draft: list[int], sampler, on_token: OnToken, start: float,
                          draft_s: float) -> bool:
        base = self.seq_len
        rows = [self.last_token, *draft]
        out = self.trunk.forward([self.segment(rows, logits="all", verify=True)])[0]
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
        self._plugin_call("keep", self.speculator.keep, self._state, num_kept)
        self._commit(rows[:num_kept], None if out.hidden is None else out.hidden[:num_kept], base)
        self.last_token = token
        self._record_spec(len(draft), num_accepted, num_kept, start, draft_s)
        return stop

    def _record_spec(self, num_drafted: int, num_accepted: int, num_emitted: int, start: float,
                     draft_s: float) -> None:
        elapsed = self.clock() - start
        self._record_step("spec", num_drafted, num_accepted, num_emitted)
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        if self.governor is not None:
            self.governor.record_spec_step(elapsed, num_emitted=num_emitted, num_accepted=num_accepted,
                                           num_drafted=num_drafted, draft_s=draft_s)
        if self.window is not None:
            self.window.record(num_drafted, num_accepted, num_drafted + 1, elapsed)

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

    def _commit(self, tokens: Sequence[int], hidden_rows, start_pos: int) -> None:
        if hidden_rows is not None:
            self._hidden_prev = hidden_rows[-1]
        if self._follows:
            self._plugin_call("commit", self.speculator.commit, self._state, list(tokens), hidden_rows, start_pos)
