"""The API key (VERISPEC_API_KEY, or `verispec serve --api-key KEY`, which other users of the
machine see in `ps`): every /v1/* request must carry `Authorization: Bearer KEY`, what OpenAI's
official clients send. The chat page, /health and /metrics stay open (the page asks for the key
and sends it with its requests)."""
from __future__ import annotations

import hmac

from verispec.server.protocol import error_response


class APIKeyCheck:
    """ASGI middleware: a /v1/* request without `Authorization: Bearer <api_key>` answers 401 in
    OpenAI's error shape (code "invalid_api_key"); the scheme is case-insensitive (RFC 7235:
    `bearer`, `BEARER`), the key is compared in constant time."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key is empty: give a key, or no key to serve without one")
        self.app, self._expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, key = sent.partition(b" ")
            if not (hmac.compare_digest(key.lstrip(b" "), self._expected) and scheme.lower() == b"bearer"):
                problem = "carries a wrong API key" if sent else "carries no API key"
                response = error_response(
                    f"the request {problem}: send the header 'Authorization: Bearer KEY' with this server's key "
                    "(OpenAI clients: api_key=KEY)", code="invalid_api_key", status_code=401)
                response.headers["www-authenticate"] = "Bearer"
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
