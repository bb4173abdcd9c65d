"""The wire format: request bodies as OpenAI's API spells them, their limits, and the error
body every refusal answers with (`error`)."""
from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.tokenizer import text_problem

#: most top logprobs a request may ask for (OpenAI's chat limit; vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
#: JSON has no -inf: an impossible token's logprob is reported as this (vLLM does the same).
MIN_LOGPROB = -9999.0
ASSISTANT = "assistant"
#: the message roles OpenAI's chat API accepts.
ROLES = ("system", "developer", "user", ASSISTANT, "tool")
#: seconds a generation may run (`verispec serve --request-timeout`).
DEFAULT_REQUEST_TIMEOUT = 600.0
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


class VerispecOptions(BaseModel):
    """The request's `verispec` extension: {"speculation": false} decodes it plainly (same output)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    speculation: bool = True


class RequestBody(BaseModel):
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
    verispec: VerispecOptions | None = None

    def speculate(self) -> bool:
        return self.verispec is None or self.verispec.speculation

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
            check_text(text, "stop" if isinstance(self.stop, str) else f"stop[{i}]")
        return stops

    def requested_limit(self) -> tuple[str, int] | None:
        """(field, value) of a max_tokens the client sent; None when it left it out."""
        sent = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        return ("max_tokens", self.max_tokens) if sent else None

    def unsupported(self) -> dict[str, bool]:
        """Field -> whether this request uses it in a way the server cannot honour."""
        return {"n": self.n != 1, "logit_bias": bool(self.logit_bias)}


class CompletionBody(RequestBody):
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
        check_text(self.role, f"messages[{index}].role")
        if self.role not in ROLES:
            shown = self.role if len(self.role) <= 40 else self.role[:40] + "..."
            raise RequestRejected(f"messages[{index}].role: {shown!r} is not a role; use one of "
                                  f"{', '.join(ROLES)}", f"messages[{index}].role")
        if self.content is None and self.role != ASSISTANT:
            raise RequestRejected(f"messages[{index}].content: a {self.role} message needs content (text or text "
                                  "parts); only an assistant message may leave it null",
                                  f"messages[{index}].content")
        if self.content is None or isinstance(self.content, str):
            check_text(self.content or "", f"messages[{index}].content")
            return {"role": self.role, "content": self.content or ""}
        if any(part.get("type") != "text" for part in self.content):
            raise RequestRejected("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported; "
                                  "this model reads text", f"messages[{index}].content")
        for j, part in enumerate(self.content):
            field, text = f"messages[{index}].content[{j}].text", part.get("text")
            if not isinstance(text, str):
                raise RequestRejected(f"{field}: a text part's text is a string, not {_json_type(text)}; "
                                      'send {"type": "text", "text": "..."}', field)
            check_text(part["text"], field)
        return {"role": self.role, "content": "".join(part["text"] for part in self.content)}


class ChatBody(RequestBody):
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



def error_body(message: str, param: str | None = None, code: str | None = None, *,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, param: str | None = None, code: str | None = None, *, status_code: int = 400,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, param, code, kind=kind), status_code=status_code)


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


def validation_problem(errors) -> tuple[str, str | None]:
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


def check_text(text: str, field: str) -> None:
    """Reject a field that is not Unicode text (a lone surrogate from a JSON escape such as
    "\\ud800"); the message names the field and never echoes the text (it cannot be encoded)."""
    problem = text_problem(text)
    if problem:
        raise RequestRejected(f"{field}: {problem}; send Unicode text (valid UTF-8)", field, "invalid_text")


def _json_type(value) -> str:
    """JSON's name for a parsed value's type, with its article ("an object", "an array", ...)."""
    names = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}
    return "null (or missing)" if value is None else names.get(type(value), type(value).__name__)
