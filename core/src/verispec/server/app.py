"""The FastAPI app: routes and the request lifecycle (`Served`), and `serve` / `server` that run it
under uvicorn; the body-read middleware is body_limit.py's, /metrics' text metrics.py's."""
from __future__ import annotations

import asyncio
import ipaddress
import sys
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.engine import Generation, InferenceEngine, TokenEvent
from verispec.errors import VerispecError, larger_context_advice
from verispec.seams import ContextOverflow, declared
from verispec.server.auth import APIKeyCheck
from verispec.server.body_limit import BodyRead
from verispec.server.connection import DEFAULT_HEADER_TIMEOUT, HostCheck, header_timeout_protocol
from verispec.server.engine_thread import EngineThread
from verispec.server.metrics import prometheus_text
from verispec.server.page import add_chat_page
from verispec.server.protocol import (ASSISTANT, ChatBody, CompletionBody, DEFAULT_BODY_TIMEOUT,
                                      DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_TIMEOUT, RequestBody,
                                      RequestRejected, SHUTDOWN_GRACE_S, check_text, error_body, error_response,
                                      validation_problem)
from verispec.server.responses import EventStream, ResponseShape, sse, usage_body, verispec_body
from verispec.tensor_parallel import RankLost
from verispec.tokenizer import TokenizerError


def verispec_error(exc: VerispecError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error body) of one of verispec's errors: its `http_status` (400 unless
    it says, e.g. 500 for a model's chat template that fails, 503 for a lost tensor-parallel rank),
    which picks the type, "server_error" from 500 up."""
    status = getattr(exc, "http_status", 400)
    return status, error_body(str(exc), getattr(exc, "param", None), getattr(exc, "code", None),
                              kind="server_error" if status >= 500 else "invalid_request_error")


def create_app(engine: InferenceEngine, *, model_name: str = "verispec",
               request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, api_key: str | None = None, docs: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` (call it with uvicorn, or fastapi.testclient.TestClient;
    `server()` makes a uvicorn server whose shutdown ends running generations at once, with the
    Host check and the header timeout of verispec.server.connection in front of the app).

    model_name: the id /v1/models lists and responses echo.
    request_timeout: seconds a generation may run before it ends with finish_reason "length".
    max_body_bytes: the largest request body read; a larger one answers 413 naming the limit.
    body_timeout: seconds a request body may take to arrive whole; a slower one answers 408 and
    its connection closes.
    api_key: when given, /v1/* requires `Authorization: Bearer <api_key>` (verispec.server.auth).
    docs: serve FastAPI's /docs, /redoc and /openapi.json (off by default: the first two load
    scripts from a CDN onto the origin whose localStorage holds the chat page's key, and they
    stay open under an api_key).
    """
    if not request_timeout > 0:
        raise ValueError(f"request_timeout={request_timeout}: give a positive number of seconds")
    if not max_body_bytes > 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}: give a positive number of bytes")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout={body_timeout}: give a positive number of seconds")
    app = FastAPI(title="verispec", description="OpenAI-compatible speculative decoding server",
                  **({} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    served = Served(engine, model_name, request_timeout)
    app.state.verispec = served  # server() ends its generations when the server shuts down
    app.add_middleware(BodyRead, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)  # added last: it runs first, before the body is read

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        message, param = validation_problem(exc.errors())
        return error_response(message, param)

    @app.exception_handler(StarletteHTTPException)  # unknown path (404), wrong method (405): OpenAI's body
    async def _http_error(request: Request, exc: StarletteHTTPException):
        routes = ("GET / (the chat page), GET /health, GET /metrics, GET /v1/models, POST /v1/completions, "
                  "POST /v1/chat/completions")
        return error_response(f"{request.method} {request.url.path}: {exc.detail}; this server serves {routes}",
                      status_code=exc.status_code, kind="invalid_request_error")

    # RequestRejected, SamplingParams, the engine (max_tokens, empty prompt), ContextOverflow, ...
    @app.exception_handler(VerispecError)
    async def _rejected(request: Request, exc: VerispecError):
        status, body = verispec_error(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(Exception)  # a bug: OpenAI's body, status 500 (the exception is still logged)
    async def _internal(request: Request, exc: Exception):
        return error_response(f"internal error ({type(exc).__name__}): a bug in verispec or a plugin, not in the "
                      "request", status_code=500, kind="server_error")

    add_chat_page(app)  # GET /, /chat.js, /chat.css (verispec.server.page)

    @app.get("/health")
    async def health():
        speculator = engine.speculator
        problem = served.engine_thread.health()
        if problem is not None:  # 503: a load balancer stops sending requests here
            return JSONResponse({"status": "unhealthy", "detail": problem}, status_code=503)
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
            check_text(body.prompt, "prompt")
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
          body_timeout: float = DEFAULT_BODY_TIMEOUT, api_key: str | None = None,
          allowed_hosts: Sequence[str] = (), docs: bool = False) -> None:
    """Run the server with uvicorn until interrupted (Ctrl-C or SIGTERM: running generations end
    at their next token, their responses finish, and the server exits; uvicorn then re-raises
    the signal, so Ctrl-C reaches the caller as KeyboardInterrupt). A host other than loopback
    without an api_key gets a warning line on stderr first (exposure_warning). A lost
    tensor-parallel rank shuts the server down (see `server`), then raises its RankLost.
    allowed_hosts: names besides IP addresses and localhost that requests' Host header may carry
    ("*": any; see `server`)."""
    app = create_app(engine, model_name=model_name, request_timeout=request_timeout,
                     max_body_bytes=max_body_bytes, body_timeout=body_timeout, api_key=api_key, docs=docs)
    warning = None if api_key else exposure_warning(host, port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    app.state.allowed_hosts = tuple(allowed_hosts)  # server()'s Host check
    server(app, host=host, port=port).run()
    if app.state.verispec.lost is not None:
        raise app.state.verispec.lost


def exposure_warning(host: str, port: int) -> str | None:
    """The line `serve` prints when `host` is not a loopback address (127.0.0.0/8, ::1, localhost)
    and no API key is set: whoever reaches the port runs the model. None on loopback."""
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay on this machine
        loopback = host.lower() == "localhost"
    if loopback:
        return None
    return (f"verispec: warning: serving on {host}:{port}, which other machines may reach, without an API key: "
            "anyone who reaches it can run the model; pass --api-key KEY (or set VERISPEC_API_KEY), or serve "
            "on 127.0.0.1 (the default)")


def server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, allowed_hosts: Sequence[str] | None = None,
           header_timeout: float = DEFAULT_HEADER_TIMEOUT, **config: Any):
    """A uvicorn.Server for `app` (from create_app) whose shutdown does not wait for generations:
    when it begins (Ctrl-C, SIGTERM, `should_exit`), every running or waiting generation ends at
    its next token with finish_reason "length", as a client's cancel does; a response still
    unfinished after SHUTDOWN_GRACE_S seconds is dropped. When it returns, the engine thread has
    ended (no forward runs while the interpreter exits). A lost tensor-parallel rank
    (tensor_parallel.RankLost: the model cannot run again) begins the shutdown once its requests
    have their 503s: a supervisor (systemd, Kubernetes) then restarts the whole group, where a
    server left up would refuse every request.
    In front of the app (verispec.server.connection): a request whose Host header is neither an IP
    address, localhost nor one of `allowed_hosts` (None: `app.state.allowed_hosts`, which `serve`
    sets, else none) answers 421 (a DNS-rebinding page cannot reach a loopback server under its
    own name), and a connection whose request headers are not whole `header_timeout` seconds
    after it opened (or after its last response) is closed.
    config: more uvicorn.Config fields."""
    import uvicorn

    served: Served = app.state.verispec

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
    config.setdefault("http", header_timeout_protocol(header_timeout))
    if allowed_hosts is None:
        allowed_hosts = getattr(app.state, "allowed_hosts", ())
    running = _Server(uvicorn.Config(HostCheck(app, allowed_hosts), host=host, port=port, **config))
    served.on_lost = lambda: setattr(running, "should_exit", True)
    return running



class Served:
    """The engine, the thread stepping it, and the OpenAI response shapes for both endpoints."""

    def __init__(self, engine: InferenceEngine, model_name: str,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.engine, self.model_name, self.request_timeout = engine, model_name, request_timeout
        self.engine_thread = EngineThread(engine)
        self.created = int(time.time())
        #: generations started and maybe not yet finished (close() cancels them; weak: a finished
        #: one leaves when its response is gone).
        self.live: weakref.WeakSet[Generation] = weakref.WeakSet()
        self.closing = False
        #: the RankLost that ended a tensor-parallel trunk (None while every rank answers), and what
        #: to call then (`server()` shuts down; a bare create_app stays up answering 503s).
        self.lost: RankLost | None = None
        self.on_lost = lambda: None

    def check_token_ids(self, ids: list[int]) -> None:
        vocab_size = self.engine.trunk.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size}); "
                                  "send ids from this model's tokenizer", "prompt")

    async def start(self, body: RequestBody, prompt, logprobs: int | None, param: str) -> Generation:
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
                                              ignore_eos=body.ignore_eos, time_limit=self.request_timeout,
                                              speculate=body.speculate())
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
            try:
                events = generation.poll()
            except RankLost as e:
                if self.lost is None:
                    self.lost = e
                    self.on_lost()
                raise
            for event in events:
                yield event
            if generation.done:
                return
            await arrived.wait()
            arrived.clear()

    async def respond(self, request: Request, body: RequestBody, prompt, logprobs: int | None, *, chat: bool):
        generation = await self.start(body, prompt, logprobs, "messages" if chat else "prompt")
        shape = ResponseShape(self.engine.tokenizer, self.model_name, chat=chat, logprobs=logprobs is not None)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(self._event_stream(shape, generation, usage), media_type="text/event-stream")
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

    async def _event_stream(self, shape: ResponseShape, generation: Generation, usage: bool) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield sse(shape.chunk({"role": ASSISTANT, "content": ""}))
            async for event in self.events(generation):
                yield sse(shape.token_chunk(event))
        except VerispecError as e:  # after the 200 went out: the error is the stream's last event
            yield sse(verispec_error(e)[1])
            return
        finally:  # the client left mid-stream (see EventStream): its request leaves the batch
            self.cancel(generation)
        result = generation.result
        yield sse({**shape.chunk({} if shape.chat else "", finish_reason=result.finish_reason),
                   "verispec": verispec_body(result)})
        if usage:
            yield sse({**shape.header(), "choices": [], **usage_body(result)})
        yield "data: [DONE]\n\n"
