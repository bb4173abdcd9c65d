"""The chat page at `/` of `verispec serve`: static HTML, CSS and plain JavaScript shipped in
the package (verispec/server/static/), no build step, nothing fetched from elsewhere. The page
streams chat turns from the server's own /v1/chat/completions and shows, under each answer,
the response's `verispec` numbers and why it speculated or not."""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: the files the page is made of: URL path -> (file under static/, content type).
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat.css": ("chat.css", "text/css; charset=utf-8"),
}

#: the page loads its own script and style only, and talks to this server only.
_HEADERS = {"content-security-policy": "default-src 'self'; img-src 'self' data:",
            "cache-control": "no-cache", "x-content-type-options": "nosniff"}


def add_chat_page(app: FastAPI) -> None:
    """Serve the chat page's files (ASSETS) from `app` with their content types. Raises
    FileNotFoundError when a file is missing from the installed package (a broken install)."""
    static = resources.files("verispec.server") / "static"
    for path, (name, media_type) in ASSETS.items():
        body = (static / name).read_bytes()  # read once: the files do not change while serving
        app.add_api_route(path, _responder(body, media_type), methods=["GET"], include_in_schema=False)


def _responder(body: bytes, media_type: str):
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)
    return asset
