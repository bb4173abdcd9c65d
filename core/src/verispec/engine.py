"""InferenceEngine: one loaded trunk serving requests, with speculation armed when it pays.

A request: render/encode the prompt → reuse the longest cached prefix → chunked prefill →
decode steps through `SpeculativeExecution` until a stop token, a stop string, max_tokens
or a full context. Tokens reach the consumer one at a time, in order.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import attrs

from verispec.errors import InvalidArgument
from verispec.execution import ExecutionStats, SpeculativeExecution, resolve_draft_window
from verispec.governor import SpeculationCostGovernor
from verispec.sampling import Sampler, SamplingParams
from verispec.nn.state import CannotTruncate
from verispec.seams import ContextOverflow, declared
from verispec.window import DraftWindow

log = logging.getLogger("verispec")

SPEC_TYPES_BUILTIN = ("auto", "draft-head", "block")


@attrs.frozen
class SpecOptions:
    """The speculation policy (the --spec* flags); validated at construction."""

    enabled: bool = True
    #: auto | draft-head | block | <registered name>, e.g. ngram.
    spec_type: str = "auto"
    #: explicit --spec-draft (1..64); None = default 8 narrowed by the trunk's preference.
    draft_window: int | None = attrs.field(default=None)
    #: explicit --spec-pmin in the algorithm's units (0..1); None = the algorithm's default.
    min_draft_prob: float | None = attrs.field(default=None)
    #: --draft-model: a drafter GGUF; its general.architecture decides what it is.
    draft_model: str | None = None
    #: --spec-adaptive: False forces drafting (for measurements).
    adaptive: bool = True

    @draft_window.validator
    def _check_window(self, attribute, value):
        if value is not None and not 1 <= value <= 64:
            raise InvalidArgument(f"--spec-draft {value}: choose 1..64")

    @min_draft_prob.validator
    def _check_pmin(self, attribute, value):
        if value is not None and not 0.0 <= value <= 1.0:
            raise InvalidArgument(f"--spec-pmin {value}: choose 0..1")


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
    #: time to first token (prefill of the unreused prompt + the first draw).
    ttft_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    speculator: str | None
    spec: ExecutionStats
    governor: str | None


class InferenceEngine:
    """Serves one trunk. `target.tokenizer` turns text into ids and back."""

    def __init__(self, target, *, registry=None, spec: SpecOptions = SpecOptions(), prefill_chunk: int = 512):
        self.target = target
        self.tokenizer = target.tokenizer
        self.registry = registry
        self.prefill_chunk = prefill_chunk
        self.seq = target.new_sequence()  # the one sequence requests run in (reused for prefix reuse)
        self._cached: list[int] = []  # tokens the sequence holds, in order
        self._governors: dict[tuple, tuple[SpeculationCostGovernor, DraftWindow]] = {}
        self.speculator = None
        self.choice = None
        self.update_speculation(spec)

    # -- speculation policy --------------------------------------------------------------

    def update_speculation(self, spec: SpecOptions) -> None:
        """Swap the speculation policy between requests, without reloading the model.

        Raises SpeculationUnavailable when an explicit --spec-type cannot serve this trunk.
        """
        if self.speculator is not None:
            self.speculator.close()
        self.spec, self.speculator, self.choice, self.fault = spec, None, None, None
        self.draft_window = resolve_draft_window(spec.draft_window, self.target)
        refusal = declared(self.target, "speculation_refusal")
        if not spec.enabled or self.registry is None:
            return
        if refusal is not None:
            if spec.spec_type != "auto":  # DESIGN §3: an explicit type that cannot serve is an error
                from verispec.registry import SpeculationUnavailable

                raise SpeculationUnavailable(spec.spec_type, {spec.spec_type: f"the trunk refuses speculation: "
                                                                              f"{refusal}"})
            log.warning("speculation off: %s", refusal)
            return
        draft_head = self._load_draft_head(spec.draft_model)
        self.choice = self.registry.choose_speculator(
            spec.spec_type, self.target, draft_head=draft_head, max_draft_tokens=self.draft_window,
            min_draft_prob=spec.min_draft_prob)
        self.speculator = self.choice.speculator
        log.info("speculation: %s", self.choice.reason)

    def _plugin_fault(self, reason: str) -> None:
        """A speculator faulted mid-request (execution module docstring): one warning naming its
        distribution, and it is switched off for this engine; the request goes on plainly."""
        entry = self.registry.speculators.get(self.choice.name) if self.registry and self.choice else None
        origin = f" from {entry.distribution} {entry.version}" if entry and entry.distribution else ""
        log.warning("%s%s; switched off for this engine, decoding plainly", reason, origin)
        self.speculator = None
        self.fault = reason

    def _load_draft_head(self, path):
        if path is None:
            return getattr(self.target, "draft_head", None)
        from verispec.gguf_io import read_architecture
        from verispec.specs import resolve

        spec = self.registry.draft_file_for_architecture(read_architecture(path))
        return resolve(spec.loader)(path, self.target)

    def reset_cache(self) -> None:
        """Forget the cached prefix: the next request prefills from an empty sequence."""
        self.target.truncate(self.seq, 0)
        self._cached = []

    def governor(self) -> tuple[SpeculationCostGovernor, DraftWindow]:
        """One governor and draft-window model per (model, drafter, backend), shared by every request."""
        key = (id(self.target), self.speculator.name, self.spec.adaptive, self.draft_window)
        if key not in self._governors:
            self._governors[key] = (SpeculationCostGovernor(enabled=self.spec.adaptive),
                                    DraftWindow(self.draft_window))
        governor, window = self._governors[key]
        window.reset()  # acceptance is per request; measured row costs carry over
        return governor, window

    # -- requests ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], *, chat: bool = False) -> list[int]:
        """Text, token ids, or chat messages ([{"role", "content"}]) → token ids."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode(self.tokenizer.render_chat([{"role": "user", "content": prompt}]),
                                             add_special=False)
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode(self.tokenizer.render_chat(list(prompt)), add_special=False)
        return [int(t) for t in prompt]

    def generate(self, prompt, *, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 stop: Sequence[str] = (), ignore_eos: bool = False, chat: bool = False,
                 time_limit: float | None = None) -> "Generation":
        """Start a request; iterate the returned Generation for TokenEvents, then read `.result`.

        time_limit: seconds, counted from the first iteration; the token during which it runs
        out is the last one (finish_reason "length"), as when max_tokens is reached.
        """
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens={max_tokens}: ask for at least 1 token")
        ids = self.encode(prompt, chat=chat)
        if not ids:
            raise InvalidArgument("empty prompt: give at least one token")
        if len(ids) >= self.target.max_context_length:
            raise ContextOverflow(len(ids) + 1, self.target.max_context_length)
        if time_limit is not None and not time_limit > 0:
            raise InvalidArgument(f"time_limit={time_limit}: give a positive number of seconds, or None")
        generation = Generation()  # its events read generation.cancelled
        generation._events = self._run(ids, max_tokens, sampling, tuple(stop), ignore_eos, time_limit,
                                       generation)
        return generation

    def _run(self, ids: list[int], max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...],
             ignore_eos: bool, time_limit: float | None = None,
             generation: "Generation | None" = None) -> Iterator[TokenEvent | GenerationResult]:
        """One request: its TokenEvents in order, then its GenerationResult."""
        start = time.perf_counter()
        reused = self._reuse_prefix(ids)
        speculator = self.speculator
        governor, window = self.governor() if speculator is not None else (None, None)
        stop_ids = () if ignore_eos else tuple(self.tokenizer.stop_ids)
        execution = SpeculativeExecution(self.target, self.seq, speculator, draft_window=self.draft_window,
                                         stop_token_ids=stop_ids, governor=governor, window=window,
                                         on_plugin_fault=self._plugin_fault)
        if reused:
            execution.seed_committed(ids[:reused])
        if governor is not None:
            room = self.target.max_context_length - len(ids)
            governor.start_request(min(max_tokens, room) - 1)  # the first token comes from prefill
        state = _StopState(self.tokenizer, ids, stop_ids, stop, max_tokens, self.target.max_context_length,
                           deadline=None if time_limit is None else start + time_limit, generation=generation)
        sampler = Sampler(sampling, ids, self.target.vocab_size)
        stopped = execution.start(ids[reused:], sampler, state.on_token)
        first_token_at = time.perf_counter()
        yield from state.drain()
        while not stopped:
            stopped = execution.step(sampler, state.on_token)
            yield from state.drain()
        end = time.perf_counter()
        # the sequence holds the prompt and every emitted token but the pending last one
        self._cached = (list(ids) + state.tokens)[:execution.seq_len]
        n = len(state.tokens)
        ttft_s = first_token_at - start
        yield GenerationResult(
            tokens=state.tokens, text=state.text(), finish_reason=state.finish_reason, prompt_tokens=len(ids),
            reused_prefix_tokens=reused, ttft_ms=1e3 * ttft_s,
            prefill_tokens_per_s=(len(ids) - reused) / ttft_s,
            decode_tokens_per_s=(n - 1) / (end - first_token_at) if n > 1 and end > first_token_at else 0.0,
            speculator=speculator.name if speculator is not None else None, spec=execution.stats,
            governor=governor.stats_line() if governor is not None else None)

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Cut the sequence back to the longest prefix shared with the last request (at least one
        row is re-forwarded); returns the number of reused tokens."""
        common = 0
        limit = min(len(self._cached), len(ids) - 1)
        while common < limit and self._cached[common] == ids[common]:
            common += 1
        try:
            self.target.truncate(self.seq, common)
        except CannotTruncate:  # e.g. recurrent state: start afresh
            common = 0
            self.target.truncate(self.seq, 0)
        del self._cached[common:]
        return common


class Generation:
    """Iterator over TokenEvents of one request; `.result` (a GenerationResult) once exhausted."""

    def __init__(self, events: Iterator[TokenEvent | GenerationResult] | None = None):
        self._events = events
        self.result: GenerationResult | None = None
        self.cancelled = False

    def cancel(self) -> None:
        """End the generation at its next token, as max_tokens would (finish_reason "length"):
        the engine is left exact. Safe to call from another thread while it is iterated."""
        self.cancelled = True

    def __iter__(self) -> Iterator[TokenEvent]:
        for item in self._events:
            if isinstance(item, GenerationResult):
                self.result = item
            else:
                yield item


class _StopState:
    """Decides, token by token, whether generation ends there (stop id, stop string, length)."""

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
