"""The body-read middleware: a request's body read whole, bounded in size and time, before the
app sees it."""
from __future__ import annotations

import anyio
from fastapi.responses import Response

from verispec.server.protocol import error_response


class BodyRead:
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
            return await self._close_with(scope, receive, send, error_response(
                f"the request body did not arrive within {self.timeout:g} s ({came} came); send the whole "
                "body with the headers", code="request_timeout", status_code=408))
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():  # the body once, then the client's messages (its disconnect)
            return replay.pop() if replay else await receive()
        await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send, size: str) -> None:
        mib = self.max_bytes / 2**20
        await self._close_with(scope, receive, send, error_response(
            f"the request body {size}; this server reads at most {self.max_bytes} bytes ({mib:g} MiB): "
            "send a shorter prompt", code="request_too_large", status_code=413))

    @staticmethod
    async def _close_with(scope, receive, send, response: Response) -> None:
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)
