"""OpenAI-compatible HTTP server over one InferenceEngine (FastAPI): `verispec serve`.

  POST /v1/completions        `prompt`: text or token ids
  POST /v1/chat/completions   `messages`, rendered through the model's chat template
  GET  /v1/models             the one loaded model
  GET  /health                {"status": "ok", "speculator": name | null}
  GET  /metrics               Prometheus text: requests running/waiting, tokens generated,
                              drafted/accepted tokens, prefix-cache hits, the KV budget
                              (budget, reserved and idle bytes)

Many clients at once: a handler queues its request in the engine's scheduler (continuous
batching: verispec.scheduler) and awaits its events; one engine thread steps the scheduler
while requests run or wait, so every running request advances in each step's one forward,
and the event loop (/health, /metrics, new requests) never waits on the model. A client that
leaves — mid-stream, or while waiting for a whole response — cancels its request: it leaves
the batch at the next step and its sequence is freed (a request abandoned while queued never
runs). A generation that runs longer than `request_timeout` seconds (`verispec serve
--request-timeout`, default 600; queueing time not counted) ends at that token with
finish_reason "length", as if max_tokens had been reached. An engine error fails the
requests of that step (HTTP 500), never the server. Tokenising a prompt (and rendering the
chat template) runs in a worker thread, never on the event loop. Shutting down (Ctrl-C,
SIGTERM: see `server()`) ends every running or waiting generation at its next token
(finish_reason "length"), so the server exits at once, its responses complete.
Speculation is the server's policy (the --spec* flags of `verispec serve`), never a request's.
The server has no authentication: `serve` on a host other than loopback warns that anyone who
reaches the port can run the model.

Request fields, as OpenAI's API: max_tokens (completions: 16 by default, as OpenAI; chat:
until a stop or a full context; `max_completion_tokens` is its newer name; a value larger
than the context leaves after the prompt is a 400 naming that limit, as OpenAI answers),
temperature
(1 by default, as OpenAI; 0 is greedy), top_p, seed, stop (a string or a list),
frequency_penalty, presence_penalty, logprobs (completions: N; chat: true + top_logprobs N),
stream, stream_options.include_usage. Extensions, spelled as vLLM does: top_k, min_p,
repetition_penalty, ignore_eos. `model` is accepted and ignored: one model is loaded.
Fields that would change the output but are not supported (n > 1, best_of, echo, suffix,
logit_bias, tools, a non-text response_format) answer 400, never a silent ignore.

Responses carry `usage` (prompt_tokens, completion_tokens, total_tokens), the engine's
finish_reason ("stop" | "length"), and an extension object `verispec` (reused prefix, queued_ms,
time to first token, speculator, drafted/accepted tokens, governor line). Logprobs are the
engine's processed logprobs (verispec.sampling); a token's text is its own decoding.

Errors: a request the engine or the sampler rejects (a prompt longer than the context, a
sampling value out of range, no chat template, malformed JSON, a prompt, message or stop
string holding a lone surrogate such as "\\ud800", which is not Unicode text, a message role
other than system, developer, user, assistant, tool, a non-assistant message without content,
a text content part whose `text` is not a string)
answers HTTP 400 with OpenAI's error body {"error": {"message", "type", "param", "code"}}; the
message says the fix and `param` names the field (e.g. "messages[1].content", "temperature"). A
body larger than `max_body_bytes` (8 MiB by default) answers 413, naming the limit; one still
incomplete `body_timeout` seconds (30 by default) after its headers answers 408; both close the
connection. A model's chat template that fails (a syntax error, a sandbox refusal, a render
bound) answers 500 naming the template error (type "server_error"); its raise_exception refusing
the messages answers 400. A bug answers 500 with the same body shape (type "server_error").

Streaming is Server-Sent Events: one `data: {chunk}` per token the engine emits (its text
may be "" while a split character or a possible stop string is held back), then a chunk
carrying finish_reason, then, with include_usage, a chunk carrying usage and `verispec`, then
`data: [DONE]`. The chunks' texts concatenate to the non-streamed text.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import re
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.engine import Generation, InferenceEngine, TokenEvent
from verispec.errors import VerispecError, larger_context_advice
from verispec.execution import acceptance_rate
from verispec.sampling import SamplingParams
from verispec.seams import ContextOverflow, declared
from verispec.tokenizer import TokenizerError, text_problem

#: most top logprobs a request may ask for (OpenAI's chat limit; vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
#: JSON has no -inf: an impossible token's logprob is reported as this (vLLM does the same).
MIN_LOGPROB = -9999.0
ASSISTANT = "assistant"
#: the message roles OpenAI's chat API accepts.
ROLES = ("system", "developer", "user", ASSISTANT, "tool")
#: seconds a generation may run (`verispec serve --request-timeout`).
DEFAULT_REQUEST_TIMEOUT = 600.0
#: seconds the engine thread waits idle before it ends (the next request starts it again).
ENGINE_THREAD_IDLE_S = 30.0
#: the largest request body read (create_app's max_body_bytes): a prompt of some 2M tokens.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: seconds a shutting-down server waits for responses to finish once their generations ended.
SHUTDOWN_GRACE_S = 5.0
#: seconds a request body may take to arrive whole (create_app's body_timeout), from its headers on.
DEFAULT_BODY_TIMEOUT = 30.0


class RequestRejected(VerispecError, ValueError):
    """A request the server refuses before generating; its message says the fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        self.param, self.code = param, code
        super().__init__(message)


# -- request bodies --------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Body(BaseModel):
    """Fields both endpoints share; ranges are checked by SamplingParams (one source of truth).
    Strict types: `"max_tokens": true` or `"stream": "yes"` is a 400, not a silent 1 or True."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None

    def sampling(self, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              seed=self.seed, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              logprobs=logprobs)

    def limit(self, max_context_length: int) -> int:
        """max_tokens for the engine; None runs until a stop or a full context."""
        return self.max_tokens if self.max_tokens is not None else max_context_length

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if "" in stops:
            raise RequestRejected("stop strings must be non-empty; leave the empty one out", "stop")
        for i, text in enumerate(stops):
            _check_text(text, "stop" if isinstance(self.stop, str) else f"stop[{i}]")
        return stops

    def requested_limit(self) -> tuple[str, int] | None:
        """(field, value) of a max_tokens the client sent; None when it left it out."""
        sent = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        return ("max_tokens", self.max_tokens) if sent else None

    def unsupported(self) -> dict[str, bool]:
        """Field -> whether this request uses it in a way the server cannot honour."""
        return {"n": self.n != 1, "logit_bias": bool(self.logit_bias)}


class CompletionBody(_Body):
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's completions limit
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self):
        return {**super().unsupported(), "echo": self.echo, "suffix": bool(self.suffix),
                "best_of": self.best_of not in (None, 1)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    #: text, or OpenAI content parts of which only {"type": "text", "text": ...} are supported.
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self, index: int = 0) -> dict[str, str]:
        """{"role", "content"}; index: its place in `messages`, named in a rejection."""
        _check_text(self.role, f"messages[{index}].role")
        if self.role not in ROLES:
            shown = self.role if len(self.role) <= 40 else self.role[:40] + "..."
            raise RequestRejected(f"messages[{index}].role: {shown!r} is not a role; use one of "
                                  f"{', '.join(ROLES)}", f"messages[{index}].role")
        if self.content is None and self.role != ASSISTANT:
            raise RequestRejected(f"messages[{index}].content: a {self.role} message needs content (text or text "
                                  "parts); only an assistant message may leave it null",
                                  f"messages[{index}].content")
        if self.content is None or isinstance(self.content, str):
            _check_text(self.content or "", f"messages[{index}].content")
            return {"role": self.role, "content": self.content or ""}
        if any(part.get("type") != "text" for part in self.content):
            raise RequestRejected("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported; "
                                  "this model reads text", f"messages[{index}].content")
        for j, part in enumerate(self.content):
            field, text = f"messages[{index}].content[{j}].text", part.get("text")
            if not isinstance(text, str):
                raise RequestRejected(f"{field}: a text part's text is a string, not {_json_type(text)}; "
                                      'send {"type": "text", "text": "..."}', field)
            _check_text(part["text"], field)
        return {"role": self.role, "content": "".join(part["text"] for part in self.content)}


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def limit(self, max_context_length):
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return chosen if chosen is not None else max_context_length

    def requested_limit(self):
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return ("max_tokens", self.max_tokens) if self.max_tokens is not None else None

    def unsupported(self):
        return {**super().unsupported(), "tools": bool(self.tools),
                "response_format": (self.response_format or {}).get("type", "text") != "text"}


# -- the app ---------------------------------------------------------------------------------

def create_app(engine: InferenceEngine, *, model_name: str = "verispec",
               request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT) -> FastAPI:
    """The FastAPI app serving `engine` (call it with uvicorn, or fastapi.testclient.TestClient;
    `server()` makes a uvicorn server whose shutdown ends running generations at once).

    model_name: the id /v1/models lists and responses echo.
    request_timeout: seconds a generation may run before it ends with finish_reason "length".
    max_body_bytes: the largest request body read; a larger one answers 413 naming the limit.
    body_timeout: seconds a request body may take to arrive whole; a slower one answers 408 and
    its connection closes.
    """
    if not request_timeout > 0:
        raise ValueError(f"request_timeout={request_timeout}: give a positive number of seconds")
    if not max_body_bytes > 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}: give a positive number of bytes")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout={body_timeout}: give a positive number of seconds")
    app = FastAPI(title="verispec", description="OpenAI-compatible speculative decoding server")
    served = _Served(engine, model_name, request_timeout)
    app.state.verispec = served  # server() ends its generations when the server shuts down
    app.add_middleware(_BodyRead, max_bytes=max_body_bytes, timeout=body_timeout)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        message, param = _validation_problem(exc.errors())
        return _error(message, param)

    @app.exception_handler(StarletteHTTPException)  # unknown path (404), wrong method (405): OpenAI's body
    async def _http_error(request: Request, exc: StarletteHTTPException):
        routes = "GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions"
        return _error(f"{request.method} {request.url.path}: {exc.detail}; this server serves {routes}",
                      status_code=exc.status_code, kind="invalid_request_error")

    # RequestRejected, SamplingParams, the engine (max_tokens, empty prompt), ContextOverflow, ...
    @app.exception_handler(VerispecError)
    async def _rejected(request: Request, exc: VerispecError):
        status = getattr(exc, "http_status", 400)  # 500: the model file's fault (a chat template that fails)
        return _error(str(exc), getattr(exc, "param", None), getattr(exc, "code", None), status_code=status,
                      kind="server_error" if status >= 500 else "invalid_request_error")

    @app.exception_handler(Exception)  # a bug: OpenAI's body, status 500 (the exception is still logged)
    async def _internal(request: Request, exc: Exception):
        return _error(f"internal error ({type(exc).__name__}): a bug in verispec or a plugin, not in the "
                      "request", status_code=500, kind="server_error")

    @app.get("/health")
    async def health():
        speculator = engine.speculator
        return {"status": "ok", "speculator": speculator.name if speculator is not None else None}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": served.created,
                                            "owned_by": "verispec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        if isinstance(body.prompt, list):
            served.check_token_ids(body.prompt)
        else:
            _check_text(body.prompt, "prompt")
        return await served.respond(request, body, body.prompt, body.logprobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestRejected("top_logprobs needs \"logprobs\": true", "top_logprobs")
        messages = [m.as_dict(i) for i, m in enumerate(body.messages)]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await served.respond(request, body, messages, logprobs, chat=True)

    return app


def serve(engine: InferenceEngine, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "verispec",
          request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
    """Run the server with uvicorn until interrupted (Ctrl-C or SIGTERM: running generations end
    at their next token, their responses finish, and the server exits; uvicorn then re-raises
    the signal, so Ctrl-C reaches the caller as KeyboardInterrupt). A host other than loopback
    gets a warning line on stderr first (exposure_warning)."""
    app = create_app(engine, model_name=model_name, request_timeout=request_timeout,
                     max_body_bytes=max_body_bytes, body_timeout=body_timeout)
    warning = exposure_warning(host, port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    server(app, host=host, port=port).run()


def exposure_warning(host: str, port: int) -> str | None:
    """The line `serve` prints when `host` is not a loopback address (127.0.0.0/8, ::1, localhost):
    the server has no authentication, so whoever reaches the port runs the model. None on loopback."""
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay on this machine
        loopback = host.lower() == "localhost"
    if loopback:
        return None
    return (f"verispec: warning: serving on {host}:{port}, which other machines may reach, and this server "
            "has no authentication: anyone who reaches it can run the model; serve on 127.0.0.1 (the "
            "default), or put an authenticating proxy in front")


def server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, **config: Any):
    """A uvicorn.Server for `app` (from create_app) whose shutdown does not wait for generations:
    when it begins (Ctrl-C, SIGTERM, `should_exit`), every running or waiting generation ends at
    its next token with finish_reason "length", as a client's cancel does; a response still
    unfinished after SHUTDOWN_GRACE_S seconds is dropped. When it returns, the engine thread has
    ended (no forward runs while the interpreter exits). config: more uvicorn.Config fields."""
    import uvicorn

    served: _Served = app.state.verispec

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            served.close()
            try:
                await super().shutdown(sockets=sockets)
                if self.force_exit:  # a second Ctrl-C skipped the waits: the lifespan task and the
                    # responses (their generations end at the next token) end now, not cancelled
                    # with a traceback when the loop closes
                    await self.lifespan.shutdown()
                    running = [task for task in self.server_state.tasks if not task.done()]
                    if running:
                        await asyncio.wait(running, timeout=SHUTDOWN_GRACE_S)
            finally:
                served.close()  # a request encoded meanwhile
                await anyio.to_thread.run_sync(served.engine_thread.stop, SHUTDOWN_GRACE_S)

    config.setdefault("timeout_graceful_shutdown", SHUTDOWN_GRACE_S)
    return _Server(uvicorn.Config(app, host=host, port=port, **config))


def _error(message: str, param: str | None = None, code: str | None = None, *, status_code: int = 400,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status_code)


#: pydantic names the member of a union it tried ("str", "list[int]"): not a part of the field's path.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|.*\[.*\])$")


def _field_path(loc) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> "messages[0].content"; None for the body itself."""
    path = ""
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_MEMBER.match(str(part)):
            path += f".{part}" if path else str(part)
    return path or None


def _validation_problem(errors) -> tuple[str, str | None]:
    """(message, param) of a body FastAPI could not read: malformed JSON says where it broke;
    a field of the wrong shape is named as OpenAI names it ("messages[1].content")."""
    for e in errors:
        if e.get("type") == "json_invalid":
            at = e["loc"][1] if len(e["loc"]) > 1 else None
            why = (e.get("ctx") or {}).get("error") or e.get("msg")
            where = f"at character {at}: {why}" if at is not None else why
            return f"the request body is not valid JSON ({where}); send one JSON object", None
    problems: dict[str | None, list[str]] = {}
    for e in errors:
        messages = problems.setdefault(_field_path(e["loc"]), [])
        if e["msg"] not in messages:
            messages.append(e["msg"])
    text = "; ".join(f"{path or 'body'}: {' or '.join(msgs)}" for path, msgs in problems.items())
    return f"invalid request: {text}", next(iter(problems), None)


def _check_text(text: str, field: str) -> None:
    """Reject a field that is not Unicode text (a lone surrogate from a JSON escape such as
    "\\ud800"); the message names the field and never echoes the text (it cannot be encoded)."""
    problem = text_problem(text)
    if problem:
        raise RequestRejected(f"{field}: {problem}; send Unicode text (valid UTF-8)", field, "invalid_text")


def _json_type(value) -> str:
    """JSON's name for a parsed value's type, with its article ("an object", "an array", ...)."""
    names = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}
    return "null (or missing)" if value is None else names.get(type(value), type(value).__name__)


def prometheus_text(engine: InferenceEngine) -> str:
    """The engine's counters in Prometheus' text exposition format (version 0.0.4)."""
    scheduler = engine.scheduler
    m = scheduler.metrics
    acceptance = acceptance_rate(m.num_accepted_tokens, m.num_draft_tokens)
    rows = [
        ("requests_running", "gauge", "Requests in the running batch.", scheduler.num_running),
        ("requests_waiting", "gauge", "Requests queued for admission.", scheduler.num_waiting),
        ("requests_finished_total", "counter", "Requests finished (any reason).", m.num_finished_requests),
        ("generated_tokens_total", "counter", "Tokens emitted to clients.", m.num_generated_tokens),
        ("draft_tokens_total", "counter", "Draft tokens verified (finished requests).", m.num_draft_tokens),
        ("accepted_tokens_total", "counter", "Draft tokens accepted (finished requests).", m.num_accepted_tokens),
        ("acceptance_rate", "gauge", "accepted_tokens_total / draft_tokens_total.", acceptance),
        ("prefix_cache_hits_total", "counter", "Requests that adopted a cached prefix.", m.num_prefix_cache_hits),
        ("prefix_cache_reused_tokens_total", "counter", "Prompt tokens not prefilled thanks to the prefix cache.",
         m.num_reused_prefix_tokens),
        ("kv_budget_bytes", "gauge", "KV/state memory budget of running and idle sequences (0: none).",
         scheduler.kv_budget.budget_bytes or 0),
        ("kv_reserved_bytes", "gauge", "KV/state memory reserved by running requests.", scheduler.kv_budget.reserved_bytes),
        ("kv_idle_bytes", "gauge", "KV/state memory held by idle prefix-cache sequences.", scheduler.kv_budget.idle_bytes),
        ("kv_budget_evictions_total", "counter", "Idle sequences released to make room in the KV budget.",
         m.num_kv_budget_evictions),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP verispec_{name} {help_text}", f"# TYPE verispec_{name} {kind}", f"verispec_{name} {value}"]
    return "\n".join(lines) + "\n"


class _EngineThread:
    """The one thread that steps the engine while requests run or wait (started on demand; it
    ends after ENGINE_THREAD_IDLE_S seconds without work)."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self._work = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def stop(self, timeout: float) -> None:
        """Finish the step under way (and any cancelled requests' last one), then end; waits up
        to `timeout` seconds, so that no forward runs while the interpreter exits."""
        with self._lock:
            self._stopping = True
            self._work.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def wake(self) -> None:
        """Something was queued or cancelled: step until the engine has no work."""
        with self._lock:
            self._work.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            if not self._work.wait(ENGINE_THREAD_IDLE_S):
                with self._lock:
                    if not self._work.is_set():
                        self._thread = None
                        return
            self._work.clear()
            while self.engine.has_work:
                self.engine.step()  # failures reach the requests of that step, never this thread
            with self._lock:
                if self._stopping:
                    self._thread = None
                    return


class _Served:
    """The engine, the thread stepping it, and the OpenAI response shapes for both endpoints."""

    def __init__(self, engine: InferenceEngine, model_name: str,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.engine, self.model_name, self.request_timeout = engine, model_name, request_timeout
        self.engine_thread = _EngineThread(engine)
        self.created = int(time.time())
        #: generations started and maybe not yet finished (close() cancels them; weak: a finished
        #: one leaves when its response is gone).
        self.live: weakref.WeakSet[Generation] = weakref.WeakSet()
        self.closing = False

    def check_token_ids(self, ids: list[int]) -> None:
        vocab_size = self.engine.trunk.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size}); "
                                  "send ids from this model's tokenizer", "prompt")

    async def start(self, body: _Body, prompt, logprobs: int | None, param: str) -> Generation:
        """Validate, encode and queue: every rejection happens here, before a 200. Tokenising
        (and rendering a chat template) runs in a worker thread: a long prompt never holds the
        event loop, so other requests, /health and /metrics answer meanwhile."""
        for field, used in body.unsupported().items():
            if used:
                raise RequestRejected(f"{field} is not supported by this server; leave it out", field)
        stops, sampling = body.stops(), body.sampling(logprobs)
        context = self.engine.trunk.max_context_length
        try:
            ids = await anyio.to_thread.run_sync(self.engine.encode, prompt)
            max_tokens = body.limit(context)
            requested = body.requested_limit()
            if requested is not None and requested[1] < 1:
                raise RequestRejected(f"{requested[0]}={requested[1]}: ask for at least 1 token", requested[0])
            if ids and len(ids) < context:
                room = context - len(ids)
                if requested is not None and requested[1] > room:
                    field, value = requested
                    raise RequestRejected(
                        f"{field}={value} does not fit: the context holds {context} tokens and the prompt "
                        f"takes {len(ids)}, leaving at most {room} new tokens; ask for at most {room}, or "
                        "shorten the prompt", field, "context_length_exceeded")
                max_tokens = min(max_tokens, room)  # completions' default 16 in a nearly full context
            generation = self.engine.generate(ids, max_tokens=max_tokens, sampling=sampling, stop=stops,
                                              ignore_eos=body.ignore_eos, time_limit=self.request_timeout)
        except ContextOverflow as e:
            advice = larger_context_advice(e.max_context_length, declared(self.engine.trunk, "trained_context_length"))
            raise RequestRejected(
                f"the prompt needs {e.required_len} positions (its tokens and one new token) but the context "
                f"holds {e.max_context_length}; shorten the prompt{advice}", param, "context_length_exceeded") from e
        except TokenizerError as e:  # NoChatTemplate, ForgedControlToken (ChatTemplateError carries its status)
            raise RequestRejected(f"cannot render the messages: {e}", param) from e
        self.live.add(generation)
        if self.closing:  # the server began shutting down while this prompt was encoded
            generation.cancel()
        self.engine_thread.wake()
        return generation

    def close(self) -> None:
        """The server is shutting down: every running or waiting generation ends at its next
        token (finish_reason "length", as a cancel), so their responses finish at once."""
        self.closing = True
        for generation in list(self.live):
            self.cancel(generation)

    def cancel(self, generation: Generation) -> None:
        if not generation.done:
            generation.cancel()
            self.engine_thread.wake()

    async def events(self, generation: Generation) -> AsyncIterator[TokenEvent]:
        """The generation's events as the engine thread draws them; ends with `.result` set.
        Raises what the engine step that ran it raised."""
        loop, arrived = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the event loop has closed (shutdown): nobody waits any more
                pass
        generation.listener = wake
        while True:
            for event in generation.poll():
                yield event
            if generation.done:
                return
            await arrived.wait()
            arrived.clear()

    async def respond(self, request: Request, body: _Body, prompt, logprobs: int | None, *, chat: bool):
        generation = await self.start(body, prompt, logprobs, "messages" if chat else "prompt")
        shape = _Shape(self, chat=chat, logprobs=logprobs is not None)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(self._sse(shape, generation, usage), media_type="text/event-stream")
        events, error = [], None
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._watch, request, generation)
            try:
                events = [event async for event in self.events(generation)]
            except Exception as e:  # noqa: BLE001 -- raised below, outside the group (no ExceptionGroup)
                error = e
            watching.cancel_scope.cancel()
        if error is not None:
            raise error
        if generation.cancelled and not generation.result.tokens:  # the client left before a token
            return Response(status_code=499)
        return shape.response(events, generation.result)

    async def _watch(self, request: Request, generation: Generation) -> None:
        """Wait for the client to leave (the body is already read), then cancel its generation."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel(generation)

    async def _sse(self, shape: _Shape, generation: Generation, usage: bool) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield _sse(shape.chunk({"role": ASSISTANT, "content": ""}))
            async for event in self.events(generation):
                yield _sse(shape.token_chunk(event))
        finally:  # the client left mid-stream (see _EventStream): its request leaves the batch
            self.cancel(generation)
        result = generation.result
        yield _sse(shape.chunk({} if shape.chat else "", finish_reason=result.finish_reason))
        if usage:
            yield _sse({**shape.header(), "choices": [], **_usage(result)})
        yield "data: [DONE]\n\n"


class _BodyRead:
    """ASGI middleware: reads an HTTP request's body before the app sees it, at most max_bytes
    within `timeout` seconds of its headers. A larger body (by its Content-Length, or as it
    arrives) answers 413, one still incomplete at the timeout (a client that sent headers and
    stalled) 408, both in OpenAI's error shape naming the limit, without reading the rest, and
    the connection closes."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send, f"is {int(length)} bytes")
        chunks, size, whole = [], 0, False
        with anyio.move_on_after(self.timeout):
            while size <= self.max_bytes:
                message = await receive()
                if message["type"] != "http.request":  # the client left while sending
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if not message.get("more_body", False):
                    whole = True
                    break
        if size > self.max_bytes:
            return await self._too_large(scope, receive, send, "is larger")
        if not whole:
            came = f"{size} of its {int(length)} bytes" if length.isdigit() else f"{size} bytes"
            return await self._close_with(scope, receive, send, _error(
                f"the request body did not arrive within {self.timeout:g} s ({came} came); send the whole "
                "body with the headers", code="request_timeout", status_code=408))
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():  # the body once, then the client's messages (its disconnect)
            return replay.pop() if replay else await receive()
        await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send, size: str) -> None:
        mib = self.max_bytes / 2**20
        await self._close_with(scope, receive, send, _error(
            f"the request body {size}; this server reads at most {self.max_bytes} bytes ({mib:g} MiB): "
            "send a shorter prompt", code="request_too_large", status_code=413))

    @staticmethod
    async def _close_with(scope, receive, send, response: Response) -> None:
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes its body generator however the stream ends.

    When the client leaves while a chunk is being sent, Starlette stops iterating, and the
    generator, suspended at a `yield`, would keep its request in the batch until garbage
    collection got to it; closing it here cancels the request at once.
    """

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _Shape:
    """OpenAI's JSON for one request: text_completion or chat.completion, whole or in chunks."""

    def __init__(self, served: _Served, *, chat: bool, logprobs: bool):
        self.chat, self.logprobs = chat, logprobs
        self.tokenizer = served.engine.tokenizer
        self.model_name = served.model_name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # characters of completion text the engine emitted before the next token

    def header(self, *, chunk: bool = True) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def chunk(self, delta, *, finish_reason: str | None = None, logprobs=None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta}
        return {**self.header(), "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def token_chunk(self, event: TokenEvent) -> dict[str, Any]:
        return self.chunk({"content": event.text} if self.chat else event.text,
                          logprobs=self.logprobs_of([event]) if self.logprobs else None)

    def response(self, events: list[TokenEvent], result) -> dict[str, Any]:
        logprobs = self.logprobs_of(events) if self.logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": ASSISTANT, "content": result.text}}
        else:
            choice = {"index": 0, "text": result.text}
        return {**self.header(chunk=False), "choices": [{**choice, "logprobs": logprobs,
                                                         "finish_reason": result.finish_reason}],
                **_usage(result)}

    def logprobs_of(self, events: list[TokenEvent]) -> dict[str, Any]:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: the legacy
        parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob),
                                 "top_logprobs": [self._entry(t, lp) for t, lp in e.top_logprobs]} for e in events]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            text = self._text(e.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(e.logprob))
            top: dict[str, float] = {}
            for t, lp in e.top_logprobs:
                top.setdefault(self._text(t), _finite(lp))  # two ids may read alike: the likelier wins
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(e.text)
        return out

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        # a token holding part of a UTF-8 character decodes to U+FFFD: its bytes are unknown here
        return {"token": text, "logprob": _finite(logprob),
                "bytes": None if "\ufffd" in text else list(text.encode("utf-8"))}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _usage(result) -> dict[str, Any]:
    n = len(result.tokens)
    return {"usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
                      "total_tokens": result.prompt_tokens + n},
            "verispec": {"reused_prefix_tokens": result.reused_prefix_tokens, "queued_ms": result.queued_ms,
                         "ttft_ms": result.ttft_ms, "speculator": result.speculator, "speculator_fault": result.speculator_fault,
                         "num_draft_tokens": result.spec.num_draft_tokens,
                         "num_accepted_tokens": result.spec.num_accepted_tokens, "governor": result.governor}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
