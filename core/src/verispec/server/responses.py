"""Response shapes: completion and chat bodies, stream chunks (Server-Sent Events), usage."""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

from verispec.engine import TokenEvent
from verispec.server.protocol import ASSISTANT, MIN_LOGPROB

class EventStream(StreamingResponse):
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


class ResponseShape:
    """OpenAI's JSON for one request: text_completion or chat.completion, whole or in chunks."""

    def __init__(self, tokenizer, model_name: str, *, chat: bool, logprobs: bool):
        self.chat, self.logprobs = chat, logprobs
        self.tokenizer, self.model_name = tokenizer, model_name
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
                **usage_body(result)}

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


def usage_body(result) -> dict[str, Any]:
    n = len(result.tokens)
    return {"usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
                      "total_tokens": result.prompt_tokens + n},
            "verispec": verispec_body(result)}


def verispec_body(result) -> dict[str, Any]:
    """The response's `verispec` field: prefix reuse, timings, the speculator's counts (named as
    vLLM's spec-decode metrics: num_drafts, num_draft_tokens, num_accepted_tokens,
    mean_acceptance_length with the bonus token, num_accepted_tokens_per_pos), the governor's line
    and why it speculated or not (`reason`: {"code", "text"}, verispec.reasons)."""
    return {"reused_prefix_tokens": result.reused_prefix_tokens, "queued_ms": result.queued_ms,
            "ttft_ms": result.ttft_ms, "decode_tokens_per_s": result.decode_tokens_per_s,
            "speculator": result.speculator, "speculator_fault": result.speculator_fault,
            "num_drafts": result.spec.num_drafts, "num_draft_tokens": result.spec.num_draft_tokens,
            "num_accepted_tokens": result.spec.num_accepted_tokens,
            "mean_acceptance_length": result.spec.mean_acceptance_length,
            "num_accepted_tokens_per_pos": list(result.spec.num_accepted_tokens_per_pos),
            "governor": result.governor, "reason": result.reason.as_dict()}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
