"""Requests and what they hand back: a Request inside the scheduler, its Generation handle, the
StopState that decides where it ends, and the values it yields (TokenEvent, GenerationResult).

A Request owns its steps: the scheduler asks it for the rows it forwards this step
(`prefill_segment`, `next_segment`) and hands it their output (`take`), then `deliver`s its
events; it never reaches into the request's execution.

Also the value types a request carries or the scheduler counts: Speculation (the policy a
request runs under) and SchedulerMetrics (what /metrics exports).

Thread safety: a Generation's events may be read from another thread than the stepping one;
`Generation.cancel` may be called from any thread.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence

import attrs

from verispec.execution import SpeculativeExecution, draft_segments
from verispec.step_stats import ExecutionStats
from verispec.reasons import SpeculationReason, request_reason
from verispec.sampling import Sampler, SamplingParams


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
    #: why it speculated or not (verispec.reasons).
    reason: SpeculationReason | None = None


@attrs.frozen
class Speculation:
    """The engine's speculation policy as requests use it: one speculator, and one governor and
    cost model shared by every request (docs/design.md §3: per (model, drafter, backend))."""

    speculator: object  # seams.Speculator
    governor: object  # SpeculationCostGovernor
    cost_model: object  # verispec.cost_model.CostModel
    #: called once with a one-line reason when the speculator faults.
    on_plugin_fault: Callable[[str], None]
    #: runs every speculator call (verispec.plugin_calls.PluginCalls; the scheduler sets its
    #: `deadline` each step), or None to call directly.
    plugin_calls: Callable | None = None


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
    #: finished requests by speculation reason code (verispec.reasons.REASON_CODES).
    num_requests_by_reason: collections.Counter = attrs.field(factory=collections.Counter)
    #: accepted drafts by draft position (0: the first draft), vLLM's num_accepted_tokens_per_pos.
    num_accepted_tokens_per_pos: list[int] = attrs.field(factory=list)

    def record_finished(self, result: GenerationResult) -> None:
        """Count a finished request's result."""
        self.num_finished_requests += 1
        self.num_draft_tokens += result.spec.num_draft_tokens
        self.num_accepted_tokens += result.spec.num_accepted_tokens
        self.num_requests_by_reason[result.reason.code] += 1
        per_pos = result.spec.num_accepted_tokens_per_pos
        self.num_accepted_tokens_per_pos.extend([0] * (len(per_pos) - len(self.num_accepted_tokens_per_pos)))
        for j, n in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[j] += n


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
        #: set to a list before the first step to have a speculating request record its steps into
        #: it (step_stats.StepRecord; also `result.spec.steps`).
        self.step_records: list | None = None

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
                 max_context_length: int, vocab_size: int, time_limit: float | None, speculate: bool = True):
        self.generation, self.ids, self.max_tokens, self.time_limit = generation, ids, max_tokens, time_limit
        #: False: this request decodes plainly whatever the engine's policy (reason "off").
        self.speculate = speculate
        self.stop_ids = stop_ids
        self.stop_state = StopState(tokenizer, ids, stop_ids, stop, max_tokens, max_context_length,
                                    generation=generation)
        self.sampler = Sampler(sampling, ids, vocab_size)
        self.max_context_length = max_context_length
        self.seq: int | None = None
        self.execution: SpeculativeExecution | None = None
        self.speculation: Speculation | None = None
        self.plain_reason: SpeculationReason | None = None  # why it runs without a speculator
        self.reused = 0
        self.num_prefilled = 0  # prompt tokens the sequence holds (the reused ones included)
        self.submitted_at = self.admitted_at = self.first_token_at = self.finished_at = 0.0

    def start_execution(self, trunk, speculation: Speculation | None, plain_reason: SpeculationReason) -> None:
        """Its SpeculativeExecution over its sequence, under `speculation` (None = plain decode,
        for `plain_reason`); its speculator hears of the reused prefix."""
        if not self.speculate:
            speculation, plain_reason = None, SpeculationReason("off", "speculation was turned off for this request")
        self.speculation, self.plain_reason = speculation, plain_reason
        if speculation is None:
            self.execution = SpeculativeExecution(trunk, self.seq, None, stop_token_ids=self.stop_ids)
            return
        self.execution = SpeculativeExecution(
            trunk, self.seq, speculation.speculator, stop_token_ids=self.stop_ids, governor=speculation.governor,
            cost_model=speculation.cost_model, max_draft_tokens=speculation.cost_model.max_draft_tokens,
            on_plugin_fault=speculation.on_plugin_fault, plugin_calls=speculation.plugin_calls,
            steps=self.generation.step_records)
        if self.reused:
            self.execution.seed_committed(self.ids[:self.reused])

    @property
    def decoding(self) -> bool:
        """The prompt is in and the first token drawn."""
        return self.execution is not None and self.execution.last_token is not None

    # -- its steps (the scheduler's side) -------------------------------------------------------

    def prefill_segment(self, max_rows: int):
        """The next chunk of its prompt, at most max_rows (>= 1) rows, as a Segment."""
        chunk = self.ids[self.num_prefilled:self.num_prefilled + max_rows]
        return self.execution.segment(chunk)

    def draft_limit(self) -> tuple[int, str | None]:
        """How many drafts its sequence allows this step, or (0, why not) (SpeculativeExecution.draft_limit)."""
        return self.execution.draft_limit(self.num_tokens_left)

    @property
    def alpha(self) -> float:
        """Its per-draft acceptance α as the plan uses it (verispec.cost_model.Acceptance.planning_alpha)."""
        return self.execution.acceptance.planning_alpha

    def draft_ahead(self, k: int) -> list[float] | None:
        """A scoring speculator's proposal of at most k drafts, made before the plan: its survivals,
        or None for any other speculator (SpeculativeExecution.draft_ahead)."""
        return self.execution.draft_ahead(k)

    def solo_plan(self) -> tuple[int, str | None]:
        """k for a step it runs alone (governor, then cost model)."""
        return self.execution.solo_plan(self.num_tokens_left)

    @staticmethod
    def next_segments(requests: Sequence["Request"], plans: Sequence[tuple[int, str | None]], *, timed: bool) -> list:
        """The rows each decoding request forwards this step, plans[i] = (k, plain cause): its pending
        token and up to k drafts; the ones that draft propose together (execution.draft_segments)."""
        return draft_segments([r.execution for r in requests], plans, timed=timed)

    def take(self, segment, out) -> bool | None:
        """Its output (a SegmentOutput) of this step's forward of `segment`; True when it finished
        (stop, length), None while its prompt is still going in."""
        if self.decoding:
            return self.execution.take(out, self.sampler, self.on_token)
        chunk = segment.tokens.tolist()
        self.execution.take_prefill(chunk, out)
        self.num_prefilled += len(chunk)
        if self.num_prefilled < len(self.ids):
            return None
        return self.execution.emit_first(self.sampler, out.logits[-1], self.on_token)

    def deliver(self) -> int:
        """Hand the events drawn since the last call to its Generation; returns how many."""
        events = list(self.stop_state.drain())
        self.generation._deliver(events)
        return len(events)

    def finish(self) -> GenerationResult:
        """It ends now: its result (after any held-back events) goes to its Generation."""
        self.finished_at = time.perf_counter()
        result = self.result()
        self.generation._deliver([*self.stop_state.drain(), result])
        return result

    def fail(self, exc: BaseException) -> None:
        """It ends with `exc`: its Generation raises it."""
        self.generation._deliver([exc])

    def cut(self) -> None:
        """End between tokens (Generation.cancel): finish_reason "length"."""
        self.stop_state.cut()

    @property
    def has_speculator(self) -> bool:
        """It runs with a speculator (armed or not)."""
        return self.execution is not None and self.execution.speculator is not None

    def detach_speculator(self) -> None:
        """Its speculator was switched off or replaced: it decodes plainly from now on."""
        if self.execution is not None and self.execution.speculator is not None:
            self.execution.detach()

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still emit (max_tokens and the context both bound it)."""
        room = self.max_context_length - len(self.ids) - len(self.stop_state.tokens)
        return min(self.max_tokens - len(self.stop_state.tokens), room)

    def held_tokens(self, num_held: int) -> list[int]:
        """The tokens its sequence holds when it holds `num_held` rows (the prompt, then every
        emitted token but the pending last one)."""
        return (self.ids + self.stop_state.tokens)[:num_held]

    def on_token(self, draw) -> bool:
        stop = self.stop_state.on_token(draw)
        if self.first_token_at == 0.0:
            self.first_token_at = time.perf_counter()
        return stop

    def result(self) -> GenerationResult:
        ttft_s = max(self.first_token_at - self.admitted_at, 1e-9) if self.first_token_at else 0.0
        n = len(self.stop_state.tokens)
        decode_s = self.finished_at - self.first_token_at
        speculation = self.speculation
        stats = self.execution.stats if self.execution is not None else ExecutionStats()
        fault = self.execution.fault if self.execution is not None else None
        governor = speculation.governor.stats if speculation is not None else None
        if speculation is not None:
            reason = request_reason(stats, fault, speculation.speculator.name, governor)
        else:  # None: cancelled before admission
            reason = self.plain_reason or SpeculationReason("too_short", "the request ended before it started")
        return GenerationResult(
            tokens=self.stop_state.tokens, text=self.stop_state.text(), finish_reason=self.stop_state.finish_reason,
            prompt_tokens=len(self.ids), reused_prefix_tokens=self.reused, ttft_ms=1e3 * ttft_s,
            prefill_tokens_per_s=(len(self.ids) - self.reused) / ttft_s if ttft_s else 0.0,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            speculator=speculation.speculator.name if speculation is not None else None, spec=stats,
            governor=speculation.governor.stats_line() if speculation is not None else None,
            speculator_fault=fault, reason=reason,
            queued_ms=1e3 * max(self.admitted_at - self.submitted_at, 0.0) if self.admitted_at else 0.0)


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
