"""InferenceEngine: one loaded trunk serving requests, with speculation armed when it pays.

A request: render/encode the prompt → queue it in the engine's `Scheduler` (continuous
batching: admitted while others decode, the longest cached prefix reused, chunked prefill
beside the others' decodes) → decode steps until a stop token, a stop string, max_tokens or
a full context. Speculation runs only while a request is alone in the engine. Tokens reach
the consumer one at a time, in order; iterating a Generation steps the engine, and a server
may instead step it from its own thread (`step`, `has_work`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from verispec.cost_model import CostModel
from verispec.errors import InvalidArgument
from verispec.plugin_calls import PLUGIN_CALL_BOUND_S, PluginCalls
from verispec.execution import resolve_max_draft_tokens
from verispec.governor import SpeculationCostGovernor
from verispec.reasons import SpeculationReason
from verispec.sampling import SamplingParams
from verispec.requests import Generation, GenerationResult, Request, Speculation, TokenEvent
from verispec.scheduler import DEFAULT_MAX_IDLE_SEQUENCES, DEFAULT_MAX_RUNNING, Scheduler
from verispec.seams import MAX_DRAFT_TOKENS, ContextOverflow, declared
from verispec.speculator_choice import SpeculationUnavailable, choose_speculator

__all__ = ["InferenceEngine", "SpecOptions", "Generation", "GenerationResult", "TokenEvent"]

log = logging.getLogger("verispec")


@attrs.frozen
class SpecOptions:
    """The speculation policy (the --spec* flags); validated at construction."""

    enabled: bool = True
    #: auto | draft-head | block | <registered name>, e.g. ngram.
    spec_type: str = "auto"
    #: explicit --spec-draft (1..MAX_DRAFT_TOKENS); None = default 8 narrowed by the trunk's preference.
    max_draft_tokens: int | None = attrs.field(default=None)
    #: explicit --spec-pmin in the algorithm's units (0..1); None = the algorithm's default.
    min_draft_prob: float | None = attrs.field(default=None)
    #: --draft-model: a drafter GGUF (path or checkpoint alias); its general.architecture decides
    #: what it is: a drafter file, or a model family's file drafting as a second trunk.
    draft_model: str | None = None
    #: --spec-adaptive: False forces drafting (for measurements).
    adaptive: bool = True

    @max_draft_tokens.validator
    def _check_window(self, attribute, value):
        if value is not None and not 1 <= value <= MAX_DRAFT_TOKENS:
            raise InvalidArgument(f"--spec-draft {value}: choose 1..{MAX_DRAFT_TOKENS}")

    @min_draft_prob.validator
    def _check_pmin(self, attribute, value):
        if value is not None and not 0.0 <= value <= 1.0:
            raise InvalidArgument(f"--spec-pmin {value}: choose 0..1")


class InferenceEngine:
    """Serves one trunk to any number of requests. `declared(trunk, "tokenizer")` turns text into ids and back.

    prefill_chunk: rows one engine step forwards at most (prefill chunks beside decodes).
    max_running: requests decoding at once (later ones queue). max_idle_sequences: finished
    sequences kept for prefix reuse. kv_budget_bytes: KV/state memory of running and idle
    sequences (verispec.kv_budget; None = no budget). plugin_call_bound_s: seconds a speculator
    call may run before it is abandoned and the speculator switched off (verispec.plugin_calls;
    `engine.plugin_calls.bound_s` changes it later); a call also waits no longer than the nearest
    time limit of the step's requests (`generate(time_limit=)`; it still gets PLUGIN_CALL_GRACE_S).
    """

    def __init__(self, trunk, *, registry=None, spec: SpecOptions = SpecOptions(), prefill_chunk: int = 512,
                 max_running: int = DEFAULT_MAX_RUNNING, max_idle_sequences: int = DEFAULT_MAX_IDLE_SEQUENCES,
                 kv_budget_bytes: int | None = None, plugin_call_bound_s: float = PLUGIN_CALL_BOUND_S):
        self.trunk = trunk
        self.plugin_calls = PluginCalls(plugin_call_bound_s)
        self.tokenizer = declared(trunk, "tokenizer")
        self.registry = registry
        self.scheduler = Scheduler(trunk, max_rows_per_step=prefill_chunk, max_running=max_running,
                                   max_idle_sequences=max_idle_sequences, kv_budget_bytes=kv_budget_bytes)
        self._governors: dict[tuple, tuple[SpeculationCostGovernor, CostModel]] = {}
        self.speculator = None
        self.choice = None
        self.update_speculation(spec)

    # -- speculation policy --------------------------------------------------------------

    def update_speculation(self, spec: SpecOptions) -> None:
        """Swap the speculation policy between engine steps, without reloading the model. Requests
        admitted later use it; running ones finish without speculating.

        Raises SpeculationUnavailable when an explicit --spec-type cannot serve this trunk.
        """
        with self.scheduler.step_lock:
            if self.speculator is not None:
                self.scheduler.set_speculation(None)
                self.speculator.close()
            self.spec, self.speculator, self.choice, self.fault = spec, None, None, None
            self.max_draft_tokens = resolve_max_draft_tokens(spec.max_draft_tokens, self.trunk)
            plain_reason = self._choose(spec)
            self.scheduler.set_speculation(self._speculation(), plain_reason)

    def _choose(self, spec: SpecOptions) -> SpeculationReason | None:
        """Pick the speculator; returns why there is none (verispec.reasons), else None."""
        refusal = declared(self.trunk, "speculation_refusal")
        if not spec.enabled:
            return SpeculationReason("off", "speculation is off (--no-spec)")
        if self.registry is None:
            return SpeculationReason("declined", "no speculator registry: the engine was built without plugins")
        if refusal is not None:
            if spec.spec_type != "auto":  # docs/design.md §3: an explicit type that cannot serve is an error
                raise SpeculationUnavailable(spec.spec_type, {spec.spec_type: f"the trunk refuses speculation: "
                                                                              f"{refusal}"})
            log.warning("speculation off: %s", refusal)
            return SpeculationReason("declined", f"the trunk refuses speculation: {refusal}")
        draft_head = self._load_draft_head(spec.draft_model)
        self.choice = choose_speculator(
            self.registry, spec.spec_type, self.trunk, draft_head=draft_head, draft_model=spec.draft_model,
            max_draft_tokens=self.max_draft_tokens, min_draft_prob=spec.min_draft_prob)
        self.speculator = self.choice.speculator
        log.info("speculation: %s", self.choice.reason)
        if self.choice.unused_drafter:
            log.warning("--draft-model %s is not used: %s", spec.draft_model, self.choice.unused_drafter)
        return SpeculationReason("declined", self.choice.reason) if self.speculator is None else None

    def _speculation(self) -> Speculation | None:
        if self.speculator is None:
            return None
        governor, cost_model = self.governor()
        return Speculation(self.speculator, governor, cost_model, self._plugin_fault, self.plugin_calls)

    def _plugin_fault(self, reason: str) -> None:
        """A speculator faulted mid-request (execution module docstring): one warning naming its
        distribution, and it is switched off for this engine; requests go on plainly."""
        if self.speculator is None:  # another request's execution already reported it
            return
        log.warning("%s%s; switched off for this engine, decoding plainly", reason, self._plugin_origin())
        self.speculator = None
        self.fault = reason
        self.scheduler.set_speculation(None, SpeculationReason("faulted", f"{reason}; switched off for this "
                                                                         "engine, decoding plainly"))

    def _plugin_origin(self) -> str:
        """` (from <distribution> <version>)` of the chosen speculator, or "" when the registry does not say."""
        entry = self.registry.speculators.get(self.choice.name) if self.registry and self.choice else None
        return f" (from {entry.distribution} {entry.version})" if entry and entry.distribution else ""

    def _load_draft_head(self, model):
        """What --draft-model names (a GGUF path or checkpoint alias), by its general.architecture:
        a drafter file format's head bound to the trunk, or a model family's file loaded as a
        second trunk (`seams.DraftModel`). None: the trunk's own head, if it carries one."""
        if model is None:
            return declared(self.trunk, "draft_head")
        from verispec.model_files import load_registered_trunk, resolve_model_path
        from verispec.gguf.io import read_architecture
        from verispec.seams import DraftModel
        from verispec.specs import DraftFileSpec, resolve

        path = resolve_model_path(model, self.registry, flag="--draft-model")
        spec = self.registry.drafter_for_architecture(read_architecture(path))
        if isinstance(spec, DraftFileSpec):
            return resolve(spec.loader)(path, self.trunk)
        return DraftModel(load_registered_trunk(path, self.registry), path)

    def cost_summary(self) -> dict | None:
        """What the current speculator's cost model measured (CostModel.summary), or None without one."""
        return self.governor()[1].summary() if self.speculator is not None else None

    def reset_cache(self) -> None:
        """Forget cached prefixes: the next request prefills from an empty sequence."""
        self.scheduler.reset_cache()

    def governor(self) -> tuple[SpeculationCostGovernor, CostModel]:
        """One governor and cost model per (model, drafter, backend), shared by every request; the
        cost model times the trunk's verify rows once, here (verispec.cost_model)."""
        key = (id(self.trunk), self.speculator.name, self.spec.adaptive, self.max_draft_tokens)
        if key not in self._governors:
            named = f"speculator {self.speculator.name!r}{self._plugin_origin()}"

            def on_slow_draft(reason: str) -> None:  # once per governor: a slow drafter is named once
                log.warning("%s: %s; parked, decoding plainly until the governor re-probes it", named, reason)
            governor = SpeculationCostGovernor(enabled=self.spec.adaptive, on_slow_draft=on_slow_draft)
            cost_model = CostModel(self.max_draft_tokens, adaptive=self.spec.adaptive)  # off forces drafting
            cost_model.profile(self.trunk)
            self._governors[key] = (governor, cost_model)
        return self._governors[key]

    # -- requests ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], *, chat: bool = False) -> list[int]:
        """Text, token ids, or chat messages ([{"role", "content"}]) → token ids.

        Plain text is the caller's whole prompt: special-token spellings in it ("<|im_start|>")
        are control tokens, as in llama.cpp's completion prompts. Chat messages (and text with
        chat=True) go through the chat template, where only the template's markup yields control
        tokens (`Tokenizer.encode_chat`). Raises NoChatTemplate, ChatTemplateError, InvalidText.
        """
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode_chat(list(prompt))
        return [int(t) for t in prompt]

    def generate(self, prompt, *, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 stop: Sequence[str] = (), ignore_eos: bool = False, chat: bool = False,
                 time_limit: float | None = None, speculate: bool = True) -> Generation:
        """Queue a request; iterate the returned Generation for TokenEvents, then read `.result`.

        time_limit: seconds, counted from the request's admission; the token during which it runs
        out is the last one (finish_reason "length"), as when max_tokens is reached.
        speculate: False decodes this request plainly whatever the engine's policy (its result's
        reason is "off"); the output is the same either way.
        Raises InvalidArgument (max_tokens < 1, an empty prompt, time_limit <= 0, a request whose
        KV reservation exceeds the whole KV budget) and
        ContextOverflow (a prompt that leaves no room for a new token) before queueing.
        """
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens={max_tokens}: ask for at least 1 token")
        ids = self.encode(prompt, chat=chat)
        if not ids:
            raise InvalidArgument("empty prompt: give at least one token")
        if len(ids) >= self.trunk.max_context_length:
            raise ContextOverflow(len(ids) + 1, self.trunk.max_context_length,
                                  declared(self.trunk, "trained_context_length"), prompt=True)
        if time_limit is not None and not time_limit > 0:
            raise InvalidArgument(f"time_limit={time_limit}: give a positive number of seconds, or None")
        self.scheduler.kv_budget.reservation(len(ids), max_tokens, self.trunk.max_context_length)  # never fits: raise now
        generation = Generation(self.step)
        self.scheduler.submit(Request(
            generation, ids, tokenizer=self.tokenizer, max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
            stop_ids=() if ignore_eos else tuple(self.tokenizer.stop_ids),
            max_context_length=self.trunk.max_context_length, vocab_size=self.trunk.vocab_size,
            time_limit=time_limit, speculate=speculate))
        return generation

    def step(self) -> None:
        """One engine step over every running request (see verispec.scheduler)."""
        self.scheduler.step()

    @property
    def has_work(self) -> bool:
        """Requests are running or waiting."""
        return self.scheduler.has_work
