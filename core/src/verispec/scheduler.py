"""Scheduler: continuous batching of requests over one trunk, one engine step at a time.

Requests wait in a queue and are admitted while others decode (at most `max_running` run
at once). Each step is one of:

- solo: exactly one request runs and its prompt is in. Its `SpeculativeExecution.step` runs:
  the only place speculation happens (a draft, one verify, keep), timed by the shared
  governor. A request speculates only while it is alone in the engine.
- batched: one `target.forward(batch)` over every running request's next rows — a one-row
  decode of each decoding request beside prefill chunks of newcomers, the chunks sharing a
  budget of `max_rows_per_step` rows. Never speculates; the executions still commit every
  token to their speculator state, so a request that was speculating resumes after a
  1 → N → 1 interlude without re-arming.

Arming: a hidden-free speculator that can arm after prefix reuse (n-gram) is armed late, at
the request's first solo step, over every token its sequence holds then: prefills and batched
decodes never call it, and a request that never runs alone never costs it anything. A
speculator that needs hidden rows follows the sequence from admission (it needs the
prefill's rows); after prefix reuse it arms only if it declares `can_arm_after_prefix_reuse`.

Each request samples its own rows with its own SamplingParams, stops, max_tokens and time
limit; its events reach its `Generation` as they are drawn, and it leaves the batch the step
it finishes. A cancelled request leaves at the next step and its sequence is released.

Prefix cache (a first step before paged KV): a finished request's sequence is kept idle with
the tokens it holds (at most `max_idle_sequences`, least recently used released first). A new
request starts from the longest prefix it shares with an idle or a running sequence and
prefills only the rest: it takes over an idle sequence it continues whole (the next chat
turn), and otherwise gets a copy of the prefix (`target.fork`), the source left as it was. A
trunk whose state cannot be cut back (recurrent) reuses only a whole sequence. Copies are
whole tensors, not shared blocks: paged KV would share them without copying.

KV budget (`kv_budget_bytes`): a request reserves the bytes its sequence may grow to
(`target.sequence_nbytes` of prompt + max_tokens + the widest verify) while it runs; running
reservations plus the bytes idle sequences hold stay within the budget. The head of the queue
waits (FIFO) until its reservation fits, idle sequences released first, least recently used
first; a request whose reservation alone exceeds the budget fails with InvalidArgument.

Thread safety: `submit` may be called from any thread; `step` is serialised by a lock, and a
Generation's events may be read from another thread than the stepping one.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import attrs

from verispec.errors import InvalidArgument
from verispec.execution import ExecutionStats, SpeculativeExecution
from verispec.sampling import Sampler, SamplingParams
from verispec.nn.state import MAX_VERIFY_ROWS, CannotTruncate
from verispec.seams import declared

log = logging.getLogger("verispec")

#: rows one batched step forwards at most (decodes first, then prefill chunks).
DEFAULT_MAX_ROWS_PER_STEP = 512
#: requests decoding at once; later ones wait in the queue.
DEFAULT_MAX_RUNNING = 16
#: finished sequences kept for prefix reuse.
DEFAULT_MAX_IDLE_SEQUENCES = 4


@attrs.frozen
class TokenEvent:
    token: int
    #: text this token completes (may be "" mid-character or inside a held-back stop string).
    text: str
    #: the token's processed logprob (verispec.sampling), when SamplingParams.logprobs is set; else None.
    logprob: float | None = None
    #: (token, logprob) of the SamplingParams.logprobs most likely tokens, most likely first.
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.define
class GenerationResult:
    tokens: list[int]
    text: str
    #: "stop" (stop token or string), "length" (max_tokens, a full context, the time limit, or
    #: Generation.cancel()).
    finish_reason: str
    prompt_tokens: int
    reused_prefix_tokens: int
    #: time to first token from admission (prefill of the unreused prompt + the first draw).
    ttft_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    speculator: str | None
    spec: ExecutionStats
    governor: str | None
    #: why `speculator` was switched off during this request (a plugin fault), else None.
    speculator_fault: str | None = None
    #: time from submission to admission (waiting for a running slot or KV budget).
    queued_ms: float = 0.0


@attrs.frozen
class Speculation:
    """The engine's speculation policy as requests use it: one speculator, and one governor and
    draft window shared by every request (DESIGN §3: per (model, drafter, backend))."""

    speculator: object  # seams.Speculator
    draft_window: int
    governor: object  # SpeculationCostGovernor
    window: object  # DraftWindow
    #: called once with a one-line reason when the speculator faults.
    on_plugin_fault: Callable[[str], None]


@attrs.define
class SchedulerMetrics:
    """Counters over the scheduler's life (what /metrics exports)."""

    num_finished_requests: int = 0
    num_generated_tokens: int = 0
    #: admissions that adopted a cached prefix, and the prompt tokens they did not prefill.
    num_prefix_cache_hits: int = 0
    num_reused_prefix_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: idle (prefix-cache) sequences released to make room in the KV budget.
    num_kv_budget_evictions: int = 0


class Generation:
    """One request's handle: iterate it for TokenEvents, then read `.result` (a GenerationResult).

    Iterating steps the engine whenever no event is ready, so the synchronous API needs no
    thread; a server that steps the engine in its own thread sets `listener` instead and reads
    `poll()`. A failure of the engine step that ran this request is raised by the iteration.
    """

    def __init__(self, step: Callable[[], None]):
        self._step = step
        self._items: collections.deque = collections.deque()  # TokenEvents, then the result or an error
        self.result: GenerationResult | None = None
        self.cancelled = False
        #: called from the stepping thread after new items arrive (e.g. to wake an event loop).
        self.listener: Callable[[], None] | None = None

    def cancel(self) -> None:
        """End the generation at its next token, as max_tokens would (finish_reason "length"), or
        before it starts; its sequence is released. Safe to call from another thread."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.result is not None

    def _deliver(self, items: Sequence) -> None:
        if items:
            self._items.extend(items)
            if self.listener is not None:
                self.listener()

    def poll(self) -> list[TokenEvent]:
        """The events that arrived since the last poll; sets `.result` (or raises the step's error)
        once the request finished."""
        events = []
        while self._items:
            item = self._items.popleft()
            if isinstance(item, GenerationResult):
                self.result = item
            elif isinstance(item, BaseException):
                raise item
            else:
                events.append(item)
        return events

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            yield from self.poll()
            if self.result is not None:
                return
            if not self._items:
                self._step()


class Request:
    """One generation inside the scheduler: its prompt, limits, sequence, execution and stop state."""

    def __init__(self, generation: Generation, ids: list[int], *, tokenizer, max_tokens: int,
                 sampling: SamplingParams, stop: tuple[str, ...], stop_ids: tuple[int, ...],
                 max_context_length: int, vocab_size: int, time_limit: float | None):
        self.generation, self.ids, self.max_tokens, self.time_limit = generation, ids, max_tokens, time_limit
        self.stop_ids = stop_ids
        self.state = StopState(tokenizer, ids, stop_ids, stop, max_tokens, max_context_length, generation=generation)
        self.sampler = Sampler(sampling, ids, vocab_size)
        self.max_context_length = max_context_length
        self.seq: int | None = None
        self.execution: SpeculativeExecution | None = None
        self.speculation: Speculation | None = None
        self.reused = 0
        self.num_prefilled = 0  # prompt tokens the sequence holds (the reused ones included)
        self.submitted_at = self.admitted_at = self.first_token_at = self.finished_at = 0.0

    @property
    def decoding(self) -> bool:
        """The prompt is in and the first token drawn."""
        return self.execution is not None and self.execution.last_token is not None

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still emit (max_tokens and the context both bound it)."""
        room = self.max_context_length - len(self.ids) - len(self.state.tokens)
        return min(self.max_tokens - len(self.state.tokens), room)

    def held_tokens(self, num_held: int) -> list[int]:
        """The tokens its sequence holds when it holds `num_held` rows (the prompt, then every
        emitted token but the pending last one)."""
        return (self.ids + self.state.tokens)[:num_held]

    def on_token(self, draw) -> bool:
        stop = self.state.on_token(draw)
        if self.first_token_at == 0.0:
            self.first_token_at = time.perf_counter()
        return stop

    def result(self) -> GenerationResult:
        ttft_s = max(self.first_token_at - self.admitted_at, 1e-9) if self.first_token_at else 0.0
        n = len(self.state.tokens)
        decode_s = self.finished_at - self.first_token_at
        speculation = self.speculation
        stats = self.execution.stats if self.execution is not None else ExecutionStats()
        return GenerationResult(
            tokens=self.state.tokens, text=self.state.text(), finish_reason=self.state.finish_reason,
            prompt_tokens=len(self.ids), reused_prefix_tokens=self.reused, ttft_ms=1e3 * ttft_s,
            prefill_tokens_per_s=(len(self.ids) - self.reused) / ttft_s if ttft_s else 0.0,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            speculator=speculation.speculator.name if speculation is not None else None, spec=stats,
            governor=speculation.governor.stats_line() if speculation is not None else None,
            speculator_fault=self.execution.fault if self.execution is not None else None,
            queued_ms=1e3 * max(self.admitted_at - self.submitted_at, 0.0) if self.admitted_at else 0.0)


class Scheduler:
    """Continuous batching over `target` (seams.SpeculativeTarget); see the module docstring.

    max_rows_per_step: rows one batched forward carries at most (>= 1).
    max_running: requests admitted at once (>= 1). max_idle_sequences: finished sequences kept
    for prefix reuse (0 = no prefix cache). Raises InvalidArgument outside those ranges.
    kv_budget_bytes: KV/state memory the running and idle sequences may occupy together (None =
    no budget). A request reserves `target.sequence_nbytes` of its prompt + max_tokens + the
    widest verify while it runs; the head of the queue waits (FIFO) until its reservation fits,
    idle sequences released first (least recently used), and one that could never fit fails
    with InvalidArgument. A trunk without `sequence_nbytes` (seams.declared) is not budgeted.
    """

    def __init__(self, target, *, max_rows_per_step: int = DEFAULT_MAX_ROWS_PER_STEP,
                 max_running: int = DEFAULT_MAX_RUNNING, max_idle_sequences: int = DEFAULT_MAX_IDLE_SEQUENCES,
                 kv_budget_bytes: int | None = None):
        if max_rows_per_step < 1 or max_running < 1 or max_idle_sequences < 0:
            raise InvalidArgument(f"max_rows_per_step={max_rows_per_step}, max_running={max_running}, "
                                  f"max_idle_sequences={max_idle_sequences}: choose >= 1, >= 1 and >= 0")
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise InvalidArgument(f"kv_budget_bytes={kv_budget_bytes}: choose >= 1, or None for no budget")
        self.target = target
        self.kv_budget_bytes = kv_budget_bytes
        # the trunk's memory declarations (seams), read once: None = not budgeted / estimated
        self._sequence_nbytes = declared(target, "sequence_nbytes")
        self._held_nbytes = declared(target, "sequence_held_nbytes")
        smallest = self._smallest_reservation() if kv_budget_bytes is not None else None
        if smallest is not None and smallest > kv_budget_bytes:
            raise InvalidArgument(
                f"a KV budget of {kv_budget_bytes} bytes ({kv_budget_bytes / 2**20:.2f} MiB) cannot hold one "
                f"sequence: the smallest request (1 prompt token, max_tokens 1) reserves {smallest} bytes; raise "
                f"--kv-cache-gb (kv_cache_gb=) to at least {math.ceil(smallest / 2**30 * 1e4) / 1e4:g}, or 0 for no budget")
        self._reservations: dict[Request, int] = {}  # running request -> bytes reserved for its sequence
        self.max_rows_per_step, self.max_running, self.max_idle_sequences = (max_rows_per_step, max_running,
                                                                               max_idle_sequences)
        self.speculation: Speculation | None = None
        self.metrics = SchedulerMetrics()
        self._waiting: collections.deque[Request] = collections.deque()
        self._waiting_lock = threading.Lock()  # submit() runs on any thread
        self._running: list[Request] = []
        self._idle: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # seq -> tokens held
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

    def set_speculation(self, speculation: Speculation | None) -> None:
        """The policy for requests admitted from now on; running requests stop speculating (their
        speculator may be closed). Call with `step_lock` held."""
        self.speculation = speculation
        for request in self._running:
            if request.execution.speculator is not None:
                request.execution.detach()
        self._governed = None

    def reset_cache(self) -> None:
        """Release every idle sequence: later requests prefill from scratch."""
        with self.step_lock:
            while self._idle:
                self.target.release(self._idle.popitem(last=False)[0])

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
                solo = self._running[0] if len(self._running) == 1 and self._running[0].decoding else None
                if solo is not None:
                    self._solo_step(solo)
                else:
                    self._batched_step()
            except Exception as exc:  # noqa: BLE001 -- the step's requests fail, the engine goes on
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
            request.state.cut()
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
                else:
                    log.exception("admitting a request failed")
                self._reservations.pop(request, None)
                if request.seq is not None:
                    self.target.release(request.seq)
                request.generation._deliver([exc])
                continue
            if not admitted:  # the KV budget is full: it stays at the head of the queue (FIFO)
                with self._waiting_lock:
                    self._waiting.appendleft(request)
                return

    def _admit_one(self, request: Request) -> bool:
        """Start the request; False (nothing changed) while the KV budget cannot hold it yet."""
        reservation = self.kv_reservation(len(request.ids), request.max_tokens, request.max_context_length)
        if reservation is not None:
            if self.kv_reserved_bytes + reservation > self.kv_budget_bytes:
                return False
            # an idle sequence the prompt continues whole becomes its sequence: released last, not counted
            self._evict_idle(reservation, keep=self._continued_idle(request.ids))
        request.seq, request.reused = self._reuse_prefix(request.ids)
        if reservation is not None:
            self._reservations[request] = reservation
            self._evict_idle(0)  # the kept sequence, when a running one shared a longer prefix
        request.num_prefilled = request.reused
        request.admitted_at = time.perf_counter()
        if request.time_limit is not None:
            request.state.deadline = request.admitted_at + request.time_limit
        self._start_execution(request)
        if request.reused:
            self.metrics.num_prefix_cache_hits += 1
            self.metrics.num_reused_prefix_tokens += request.reused
        self._running.append(request)
        return True

    # -- the KV budget ---------------------------------------------------------------------------

    def kv_reservation(self, num_prompt_tokens: int, max_tokens: int, max_context_length: int) -> int | None:
        """Bytes a request reserves while it runs: its sequence at prompt + max_tokens + the widest
        verify positions (at most the context), or None when nothing is budgeted. Raises
        InvalidArgument when that alone exceeds the budget (it could never be admitted)."""
        if self.kv_budget_bytes is None or self._sequence_nbytes is None:
            return None
        positions = min(num_prompt_tokens + max_tokens + MAX_VERIFY_ROWS, max_context_length)
        need = self._sequence_nbytes(positions)
        if need <= self.kv_budget_bytes:
            return need
        room = self._max_budgeted_positions(max_context_length) - MAX_VERIFY_ROWS - num_prompt_tokens
        fix = (f"ask for at most max_tokens {room}" if room >= 1 else
               f"shorten the prompt to at most {room + num_prompt_tokens - 1} tokens")
        error = InvalidArgument(
            f"this request may need {need} bytes ({need / 2**20:.2f} MiB) of KV/state memory for "
            f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens}, more than the whole KV budget of "
            f"{self.kv_budget_bytes} bytes ({self.kv_budget_bytes / 2**20:.2f} MiB); {fix}, or raise the budget "
            "(--kv-cache-gb, or kv_cache_gb= in verispec.load)")
        error.param = "max_tokens" if room >= 1 else None  # the request field to change (the server's 400)
        raise error

    def _smallest_reservation(self) -> int | None:
        """What a one-token prompt with max_tokens 1 reserves, or None when nothing is budgeted."""
        if self._sequence_nbytes is None:
            return None
        return self._sequence_nbytes(min(2 + MAX_VERIFY_ROWS, self.target.max_context_length))

    def _max_budgeted_positions(self, max_context_length: int) -> int:
        """The most positions one sequence may reach within the whole budget (0 if none): a
        binary search, as sequence_nbytes never shrinks with more positions."""
        low, high = 0, max_context_length
        while low < high:
            mid = (low + high + 1) // 2
            if self._sequence_nbytes(mid) <= self.kv_budget_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    @property
    def kv_reserved_bytes(self) -> int:
        """Bytes the running requests reserved."""
        return sum(list(self._reservations.values()))

    @property
    def kv_idle_bytes(self) -> int:
        """Bytes the idle (prefix-cache) sequences hold (0 when the trunk is not budgeted). Safe to
        read from another thread than the stepping one (/metrics): a sequence released meanwhile
        counts 0."""
        total = 0
        for seq in list(self._idle):
            try:
                total += self._idle_nbytes(seq)
            except ValueError:  # released by the stepping thread since the list was taken
                pass
        return total

    def _idle_nbytes(self, seq: int) -> int:
        if self._held_nbytes is not None:
            return self._held_nbytes(seq)
        if self._sequence_nbytes is None:
            return 0
        return self._sequence_nbytes(min(self.target.seq_len(seq) + MAX_VERIFY_ROWS, self.target.max_context_length))

    def _evict_idle(self, need: int, keep: int | None = None) -> None:
        """Release idle sequences, least recently used first and `keep` (not counted) last, until
        the reservations, the idle sequences and `need` bytes fit in the budget."""
        if self.kv_budget_bytes is None or self._sequence_nbytes is None:
            return
        while self._idle:
            idle = sum(self._idle_nbytes(seq) for seq in self._idle if seq != keep)
            if self.kv_reserved_bytes + idle + need <= self.kv_budget_bytes:
                return
            victim = next((seq for seq in self._idle if seq != keep), keep)
            keep = None if victim == keep else keep
            del self._idle[victim]
            self.target.release(victim)
            self.metrics.num_kv_budget_evictions += 1

    def _continued_idle(self, ids: list[int]) -> int | None:
        """The idle sequence with the longest history that `ids` continues whole (`_reuse_prefix`
        takes it over), or None."""
        best, longest = None, 0
        for seq, tokens in self._idle.items():
            if longest < len(tokens) < len(ids) and ids[:len(tokens)] == tokens:
                best, longest = seq, len(tokens)
        return best

    def _start_execution(self, request: Request) -> None:
        speculation = self.speculation
        request.speculation = speculation
        if speculation is None:
            request.execution = SpeculativeExecution(self.target, request.seq, None, stop_token_ids=request.stop_ids)
            return
        request.execution = SpeculativeExecution(
            self.target, request.seq, speculation.speculator, draft_window=speculation.draft_window,
            stop_token_ids=request.stop_ids, governor=speculation.governor, window=speculation.window,
            on_plugin_fault=speculation.on_plugin_fault, arm_late=True)
        if request.reused and not request.execution.arm_pending:
            request.execution.seed_committed(request.ids[:request.reused])

    def _reuse_prefix(self, ids: list[int]) -> tuple[int, int]:
        """(sequence, reused tokens) for a prompt: the longest prefix it shares with an idle or a
        running sequence (at least its last token is left to forward), or a new sequence.

        An idle sequence the prompt continues whole is taken over (nothing is lost); any other
        source is forked: its prefix is copied and the source stays as it is.
        """
        best, common = None, 0
        for seq, tokens in self._cached_sequences():
            n = _common_prefix(tokens, ids, limit=len(ids) - 1)
            if n > common:
                best, common = seq, n
        if best is None:
            return self.target.new_sequence(), 0
        if len(self._idle.get(best, ())) == common:
            del self._idle[best]
            return best, common
        try:
            return self.target.fork(best, common), common
        except CannotTruncate:  # e.g. recurrent state: only a whole sequence can be continued
            return self.target.new_sequence(), 0

    def _cached_sequences(self) -> Iterator[tuple[int, list[int]]]:
        """(sequence, the tokens it holds) of every idle and running sequence."""
        yield from self._idle.items()
        for request in self._running:
            yield request.seq, request.held_tokens(self.target.seq_len(request.seq))

    def _solo_step(self, request: Request) -> None:
        """The request is alone: its execution steps itself, speculating when the governor lets it."""
        if not self._was_solo or self._governed is not request:
            self._start_governing(request)
        if request.execution.arm_pending:  # late arming: the speculator sees what the sequence holds
            request.execution.seed_committed(request.held_tokens(self.target.seq_len(request.seq)))
        stop = request.execution.step(request.sampler, request.on_token)
        self._after_tokens(request, stop)

    def _start_governing(self, request: Request) -> None:
        """A solo phase begins: the shared governor hears of a new request, or of one resuming
        after a batched interlude (either way a request with fewer than two tokens left is never
        armed, and its first plain step follows a transition)."""
        speculation = request.speculation
        if speculation is None or request.execution.speculator is None:
            return
        if self._governed is request:
            speculation.governor.resume_request(request.num_tokens_left)
            return
        speculation.window.reset()  # acceptance is per request; measured row costs carry over
        speculation.governor.start_request(request.num_tokens_left)
        self._governed = request

    def _batched_step(self) -> None:
        """One forward over every running request's next rows; nobody speculates."""
        budget = max(self.max_rows_per_step - sum(r.decoding for r in self._running), 1)
        batch, owners = [], []
        for request in self._running:
            if request.decoding:
                batch.append(request.execution.decode_segment())
                owners.append((request, None))
                continue
            n = min(len(request.ids) - request.num_prefilled, budget)
            if n <= 0:
                continue  # its prefill waits for a later step's budget
            budget -= n
            chunk = request.ids[request.num_prefilled:request.num_prefilled + n]
            batch.append(request.execution.segment(chunk))
            owners.append((request, chunk))
        outputs = self.target.forward(batch)
        for (request, chunk), out in zip(owners, outputs):
            if chunk is None:
                stop = request.execution.take_decode(out, request.sampler, request.on_token)
            else:
                stop = self._take_prefill(request, chunk, out)
                if stop is None:
                    continue
            self._after_tokens(request, stop)

    def _take_prefill(self, request: Request, chunk: list[int], out) -> bool | None:
        """Commit a prefill chunk; at the prompt's end draw the first token. None while the prompt is not in."""
        request.execution.take_prefill(chunk, out)
        request.num_prefilled += len(chunk)
        if request.num_prefilled < len(request.ids):
            return None
        return request.execution.emit_first(request.sampler, out.logits[-1], request.on_token)

    def _after_tokens(self, request: Request, stop: bool) -> None:
        events = list(request.state.drain())
        self.metrics.num_generated_tokens += len(events)
        request.generation._deliver(events)
        if stop:
            self._finish(request, release=False)

    # -- leaving -------------------------------------------------------------------------------

    def _finish(self, request: Request, *, release: bool) -> None:
        """Deliver the result; the sequence is released, or kept idle for prefix reuse."""
        request.finished_at = time.perf_counter()
        if request in self._running:
            self._running.remove(request)
        self._reservations.pop(request, None)
        if request.seq is not None:
            self._park_sequence(request, release)
        if self._governed is request:
            self._governed = None
        result = request.result()
        self.metrics.num_finished_requests += 1
        self.metrics.num_draft_tokens += result.spec.num_draft_tokens
        self.metrics.num_accepted_tokens += result.spec.num_accepted_tokens
        request.generation._deliver([*request.state.drain(), result])

    def _park_sequence(self, request: Request, release: bool) -> None:
        if release or self.max_idle_sequences == 0:
            self.target.release(request.seq)
            return
        self._idle[request.seq] = request.held_tokens(self.target.seq_len(request.seq))
        while len(self._idle) > self.max_idle_sequences:
            self.target.release(self._idle.popitem(last=False)[0])
        self._evict_idle(0)  # within its reservation, unless it holds a verify's recurrent rows (nn.state)

    def _fail_running(self, exc: Exception) -> None:
        """A step raised: every request in it fails with that error and its sequence is released
        (its state may be half-written); later requests are served."""
        for request in list(self._running):
            self._running.remove(request)
            self._reservations.pop(request, None)
            self.target.release(request.seq)
            if self._governed is request:
                self._governed = None
            request.generation._deliver([exc])


def _common_prefix(a: list[int], b: list[int], limit: int, block: int = 64) -> int:
    """Length of the common prefix of a and b, at most `limit`: whole blocks compared as list
    slices (C speed), then token by token inside the first block that differs."""
    limit = min(limit, len(a), len(b))
    n = 0
    while n + block <= limit and a[n:n + block] == b[n:n + block]:
        n += block
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class StopState:
    """Decides, token by token, whether generation ends there (stop id, stop string, length),
    and turns tokens into the text of TokenEvents (holding back a possible stop string)."""

    def __init__(self, tokenizer, prompt: list[int], stop_ids, stop: tuple[str, ...], max_tokens: int,
                 max_context: int, *, deadline: float | None = None, generation: Generation | None = None):
        from verispec.tokenizer import StreamDecoder

        self.deadline, self.generation = deadline, generation
        self.stop_ids, self.stop, self.max_tokens = set(stop_ids), stop, max_tokens
        self.prompt_len, self.max_context = len(prompt), max_context
        self.decoder = StreamDecoder(tokenizer, context=prompt)
        self.tokens: list[int] = []
        self.draws: list = []  # verispec.sampling.Draw per token (logprobs when asked for)
        self._text = ""
        self._sent = 0  # characters of _text already handed to the consumer
        self._pending: list[TokenEvent] = []
        self.finish_reason = "length"

    def on_token(self, draw) -> bool:
        token = draw.token
        self.tokens.append(token)
        self.draws.append(draw)
        self._text += self.decoder.feed(token)
        stop = True
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif (len(self.tokens) >= self.max_tokens or self.prompt_len + len(self.tokens) >= self.max_context
              or (self.generation is not None and self.generation.cancelled)
              or (self.deadline is not None and time.perf_counter() >= self.deadline)):
            self.finish_reason = "length"
        else:
            stop = False
        if stop:
            self._text += self.decoder.flush()  # bytes of an unfinished character, as decode() shows them
        for s in self.stop:
            cut = self._text.find(s)
            if cut >= 0:
                self._text, self.finish_reason, stop = self._text[:cut], "stop", True
        self._emit(draw, final=stop)
        return stop

    def cut(self) -> None:
        """End between tokens (a cancel): finish_reason "length"; text held back for a possible
        stop string stays in the result's text only."""
        self._text += self.decoder.flush()
        self.finish_reason = "length"

    def _emit(self, draw, *, final: bool) -> None:
        # Hold back text that could be the start of a stop string until it is decided.
        hold = 0 if final else max((len(s) - 1 for s in self.stop), default=0)
        ready = max(self._sent, len(self._text) - hold)
        self._pending.append(TokenEvent(draw.token, self._text[self._sent:ready], draw.logprob, draw.top_logprobs))
        self._sent = ready

    def drain(self) -> Iterator[TokenEvent]:
        events, self._pending = self._pending, []
        return iter(events)

    def text(self) -> str:
        return self._text
