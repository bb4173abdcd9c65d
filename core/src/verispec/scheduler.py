"""Scheduler: continuous batching of requests over one trunk, one engine step at a time.

Requests wait in a queue and are admitted while others decode (at most `max_running` run
at once). Every step is one `trunk.forward(batch)` over every running request's rows: per
decoding request its pending token and k drafts (k >= 0, its own; verispec.execution), beside
prefill chunks of newcomers that share a budget of `max_rows_per_step` rows. Each request
accepts its own rows with its own sampling and stops, and keeps its sequence at its accepted
length, so its stream is its solo plain stream whatever runs beside it (on a batch-invariant trunk).

Who drafts how much:
- solo (one request, decoding, alone): the shared governor decides whether to speculate and
  times the step (verispec.governor), the cost model picks k (`SpeculativeExecution.solo_plan`).
- batched: the cost model's plan over every decoding request (verispec.cost_model: the draft
  slots, by survival, that maximise expected tokens per second of the step); a request given
  no slot decodes plainly with the reason "budget".
Every forward without prefill rows refreshes the cost model's time for its row count.

Each request samples its own rows with its own SamplingParams, stops, max_tokens and time
limit; its events reach its `Generation` as they are drawn, and it leaves the batch the step
it finishes. A cancelled request leaves at the next step and its sequence is released. A
speculator call waits no longer than the nearest time limit of the step's requests
(verispec.plugin_calls), so a hung plugin cannot hold a request past its limit.

Its parts, objects it owns: the prefix cache (verispec.prefix_cache: a finished request's
sequence kept idle, a new request starting from the longest prefix it shares with an idle or a
running one) and the KV budget (verispec.kv_budget: the head of the queue waits (FIFO) until
its reservation fits). Requests, their Generation handles and stop checking live in
verispec.requests.

Thread safety: `submit` may be called from any thread; `step` is serialised by a lock, and a
Generation's events may be read from another thread than the stepping one.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from verispec.errors import InvalidArgument, VerispecError
from verispec.kv_budget import KVBudget
from verispec.prefix_cache import PrefixCache
from verispec.reasons import SpeculationReason
from verispec.requests import Request, SchedulerMetrics, Speculation

log = logging.getLogger("verispec")

#: rows one batched step forwards at most (decodes first, then prefill chunks).
DEFAULT_MAX_ROWS_PER_STEP = 512
#: requests decoding at once; later ones wait in the queue.
DEFAULT_MAX_RUNNING = 16
#: finished sequences kept for prefix reuse.
DEFAULT_MAX_IDLE_SEQUENCES = 4


class Scheduler:
    """Continuous batching over `trunk` (seams.Trunk); see the module docstring.

    max_rows_per_step: rows one batched forward carries at most (>= 1).
    max_running: requests admitted at once (>= 1). max_idle_sequences: finished sequences kept
    for prefix reuse (0 = no prefix cache). Raises InvalidArgument outside those ranges.
    kv_budget_bytes: KV/state memory the running and idle sequences may occupy together (None =
    no budget; verispec.kv_budget). Raises InvalidArgument outside those ranges, or for a budget
    that cannot hold one sequence.
    """

    def __init__(self, trunk, *, max_rows_per_step: int = DEFAULT_MAX_ROWS_PER_STEP,
                 max_running: int = DEFAULT_MAX_RUNNING, max_idle_sequences: int = DEFAULT_MAX_IDLE_SEQUENCES,
                 kv_budget_bytes: int | None = None):
        if max_rows_per_step < 1 or max_running < 1 or max_idle_sequences < 0:
            raise InvalidArgument(f"max_rows_per_step={max_rows_per_step}, max_running={max_running}, "
                                  f"max_idle_sequences={max_idle_sequences}: choose >= 1, >= 1 and >= 0")
        self.trunk = trunk
        self.prefix_cache = PrefixCache(trunk, max_idle_sequences)
        self.kv_budget = KVBudget(trunk, kv_budget_bytes, self.prefix_cache)
        self.max_rows_per_step, self.max_running = max_rows_per_step, max_running
        self.speculation: Speculation | None = None
        self.plain_reason = SpeculationReason("off", "speculation is off")  # while speculation is None
        self.metrics = SchedulerMetrics()
        self._waiting: collections.deque[Request] = collections.deque()
        self._waiting_lock = threading.Lock()  # submit() runs on any thread
        self._running: list[Request] = []
        self._governed: Request | None = None  # the request the governor was last started for
        self._was_solo = False
        self.step_lock = threading.RLock()  # one step at a time; held to change the policy between steps

    # -- what the engine and the server read -------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def submit(self, request: Request) -> None:
        """Queue a request; it is admitted at a coming step."""
        request.submitted_at = time.perf_counter()
        with self._waiting_lock:
            self._waiting.append(request)

    def set_speculation(self, speculation: Speculation | None, plain_reason: SpeculationReason | None = None) -> None:
        """The policy for requests admitted from now on (None: plain decoding, for `plain_reason`);
        running requests stop speculating (their speculator may be closed). Call with `step_lock` held."""
        self.speculation = speculation
        self.plain_reason = plain_reason or SpeculationReason("off", "speculation is off")
        for request in self._running:
            request.detach_speculator()
        self._governed = None

    def reset_cache(self) -> None:
        """Release every idle sequence: later requests prefill from scratch."""
        with self.step_lock:
            self.prefix_cache.clear()

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        """Retire cancelled requests, admit waiting ones, run one solo or batched step. A step that
        raises fails the requests running in it (their generations raise the error), not the engine."""
        with self.step_lock:
            solo = None
            try:
                self._retire_cancelled()
                self._admit()
                if not self._running:
                    return
                self._bound_plugin_calls(self._running)
                solo = self._running[0] if len(self._running) == 1 and self._running[0].decoding else None
                if solo is not None and (not self._was_solo or self._governed is not solo):
                    self._start_governing(solo)
                self._forward_step(solo)
            except Exception as exc:  # noqa: BLE001 -- the step's requests fail, the engine goes on
                if isinstance(exc, VerispecError):  # bad input (a damaged model file): each caller reports it
                    log.info("an engine step failed: %s; its %d request(s) fail with it", exc, len(self._running))
                else:
                    log.exception("an engine step failed; its %d request(s) fail with it", len(self._running))
                self._fail_running(exc)
            self._was_solo = solo is not None

    def _retire_cancelled(self) -> None:
        with self._waiting_lock:
            cancelled = [r for r in self._waiting if r.generation.cancelled]
            for request in cancelled:
                self._waiting.remove(request)
        for request in cancelled:
            self._finish(request, release=False)
        for request in [r for r in self._running if r.generation.cancelled]:
            request.cut()
            self._finish(request, release=True)

    def _admit(self) -> None:
        while len(self._running) < self.max_running:
            with self._waiting_lock:
                if not self._waiting:
                    return
                request = self._waiting.popleft()
            try:
                admitted = self._admit_one(request)
            except Exception as exc:  # noqa: BLE001 -- that request fails, the engine goes on
                if isinstance(exc, InvalidArgument):
                    log.warning("refused a request: %s", exc)
                elif isinstance(exc, VerispecError):  # e.g. a lost tensor-parallel rank: one line, no traceback
                    log.info("admitting a request failed: %s", exc)
                else:
                    log.exception("admitting a request failed")
                self.kv_budget.free(request)
                if request.seq is not None:
                    self.trunk.release(request.seq)
                request.fail(exc)
                continue
            if not admitted:  # the KV budget is full: it stays at the head of the queue (FIFO)
                with self._waiting_lock:
                    self._waiting.appendleft(request)
                return

    def _admit_one(self, request: Request) -> bool:
        """Start the request; False (nothing changed) while the KV budget cannot hold it yet."""
        reservation = self.kv_budget.reservation(len(request.ids), request.max_tokens, request.max_context_length)
        if reservation is not None:
            if not self.kv_budget.fits(reservation):
                return False
            # an idle sequence the prompt continues whole becomes its sequence: released last, not counted
            self._make_room(reservation, keep=self.prefix_cache.continued(request.ids))
        request.seq, request.reused = self.prefix_cache.reuse(request.ids, self._running_sequences())
        if reservation is not None:
            self.kv_budget.reserve(request, reservation)
            self._make_room(0)  # the kept sequence, when a running one shared a longer prefix
        request.num_prefilled = request.reused
        request.admitted_at = time.perf_counter()
        if request.time_limit is not None:
            request.stop_state.deadline = request.admitted_at + request.time_limit
        self._bound_plugin_calls([*self._running, request])  # its speculator hears of it now
        request.start_execution(self.trunk, self.speculation, self.plain_reason)
        if request.reused:
            self.metrics.num_prefix_cache_hits += 1
            self.metrics.num_reused_prefix_tokens += request.reused
        self._running.append(request)
        return True

    def _make_room(self, need: int, keep: int | None = None) -> None:
        self.metrics.num_kv_budget_evictions += self.kv_budget.make_room(need, keep)

    def _running_sequences(self):
        """(sequence, the tokens it holds) of every running request, for prefix reuse."""
        for request in self._running:
            yield request.seq, request.held_tokens(self.trunk.seq_len(request.seq))

    def _bound_plugin_calls(self, requests) -> None:
        """Speculator calls wait no longer than the nearest time limit of `requests`, the ones in
        the step (verispec.plugin_calls: PluginCalls.deadline): a hung call cannot hold them past it."""
        runner = self.speculation.plugin_calls if self.speculation is not None else None
        if runner is not None:
            runner.deadline = min(((r.stop_state.deadline, r.time_limit) for r in requests
                                   if r.stop_state.deadline is not None), default=None)

    def _start_governing(self, request: Request) -> None:
        """A solo phase begins: the shared governor hears of a new request, or of one resuming
        after a batched interlude (either way a request with fewer than two tokens left is never
        armed, and its first plain step follows a transition)."""
        speculation = request.speculation
        if speculation is None or not request.has_speculator:
            return
        if self._governed is request:
            speculation.governor.resume_request(request.num_tokens_left)
            return
        speculation.governor.start_request(request.num_tokens_left)
        self._governed = request

    def _forward_step(self, solo: Request | None) -> None:
        """One forward over every running request's rows (module docstring)."""
        budget = max(self.max_rows_per_step - sum(r.decoding for r in self._running), 1)
        prefills = {}
        for request in self._running:
            if not request.decoding:
                n = min(len(request.ids) - request.num_prefilled, budget)
                if n > 0:  # else its prefill waits for a later step's budget
                    budget -= n
                    prefills[request] = request.prefill_segment(n)
        plan = self._plan(solo, sum(len(s.tokens) for s in prefills.values()))
        decoding = list(plan)
        segments = dict(zip(decoding, Request.next_segments(decoding, [plan[r] for r in decoding],
                                                            timed=solo is not None)))
        owners, batch = [], []
        for request in self._running:
            segment = segments.get(request) or prefills.get(request)
            if segment is not None:
                owners.append(request)
                batch.append(segment)
        start = time.perf_counter()
        outputs = self.trunk.forward(batch)
        if not prefills and self.speculation is not None:
            self.speculation.cost_model.record_forward(sum(len(s.tokens) for s in batch), time.perf_counter() - start)
        for request, segment, out in zip(owners, batch, outputs):
            stop = request.take(segment, out)
            if stop is not None:
                self._after_tokens(request, stop)

    def _plan(self, solo: Request | None, num_prefill_rows: int) -> dict:
        """(k, plain cause) per decoding request: the solo plan, or the cost model's over the batch."""
        decoding = [r for r in self._running if r.decoding]
        if solo is not None:
            return {solo: solo.solo_plan()}
        limits = {r: r.draft_limit() for r in decoding}
        if self.speculation is None or not any(k for k, _ in limits.values()):
            return {r: (0, cause) for r, (_, cause) in limits.items()}
        survivals = [r.draft_ahead(limits[r][0]) if limits[r][0] else None for r in decoding]
        ks = self.speculation.cost_model.plan([r.alpha for r in decoding], [limits[r][0] for r in decoding],
                                              num_prefill_rows, survivals=survivals)
        return {r: (k, None if k else limits[r][1] or "budget") for r, k in zip(decoding, ks)}

    def _after_tokens(self, request: Request, stop: bool) -> None:
        self.metrics.num_generated_tokens += request.deliver()
        if stop:
            self._finish(request, release=False)

    # -- leaving -------------------------------------------------------------------------------

    def _finish(self, request: Request, *, release: bool) -> None:
        """Deliver the result; the sequence is released, or kept idle for prefix reuse."""
        if request in self._running:
            self._running.remove(request)
        self.kv_budget.free(request)
        if request.seq is not None:
            self._park_sequence(request, release)
        if self._governed is request:
            self._governed = None
        result = request.finish()
        self.metrics.record_finished(result)

    def _park_sequence(self, request: Request, release: bool) -> None:
        if release:
            self.trunk.release(request.seq)
            return
        self.prefix_cache.park(request.seq, request.held_tokens(self.trunk.seq_len(request.seq)))
        self._make_room(0)  # within its reservation, unless it holds a verify's recurrent rows (nn.state)

    def _fail_running(self, exc: Exception) -> None:
        """A step raised: every request in it fails with that error and its sequence is released
        (its state may be half-written); later requests are served."""
        for request in list(self._running):
            self._running.remove(request)
            self.kv_budget.free(request)
            self.trunk.release(request.seq)
            if self._governed is request:
                self._governed = None
            request.fail(exc)
