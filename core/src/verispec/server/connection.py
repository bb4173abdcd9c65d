"""The connection before the app: the Host check (against DNS rebinding), the header timeout (a
client that opens a connection and never finishes its headers), and the port check `verispec
serve` runs before it loads the model."""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket

from verispec.errors import VerispecError
from verispec.server.protocol import error_response

#: seconds a connection may take to send a request's headers whole, from its opening (or from the
#: end of its previous response): a client that sends half its headers and stalls is closed then.
DEFAULT_HEADER_TIMEOUT = 20.0


class PortInUse(VerispecError, OSError):
    """`verispec serve --host H --port N` where that address cannot be bound (the port in use, a
    host that is not this machine's); found before the model loads."""


def check_port(host: str, port: int) -> None:
    """Bind `host`:`port` once and let it go, as uvicorn will (SO_REUSEADDR): raises PortInUse
    naming the fix when another process holds it or the address is not this machine's. Port 0
    (the OS picks one) is always free."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
    except OSError as e:
        fix = ("another process holds the port: pass another --port, or stop that process"
               if e.errno == errno.EADDRINUSE else "pass a --host of this machine (default 127.0.0.1) and a free --port")
        raise PortInUse(f"cannot serve on {host}:{port} ({e.strerror or e}): {fix}") from None


def host_allowed(host_header: str, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header (name[:port]) names this server: an IP address (v4, or v6 in
    brackets), `localhost`, or a name in `allowed` (lower case; "*" allows every name). A DNS
    rebinding page reaches a loopback server under the attacker's own name, which this refuses."""
    if "*" in allowed:
        return True
    name = host_header.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name.rstrip(".") in allowed or name.rstrip(".") == "localhost"


class HostCheck:
    """ASGI middleware: an HTTP request whose Host header names neither an IP address,
    `localhost`, nor one of `allowed_hosts` (`verispec serve --allowed-host NAME`) answers 421 in
    OpenAI's error shape naming the flag, before any route (the chat page, /health included)."""

    def __init__(self, app, allowed_hosts=()):
        self.app, self.allowed = app, frozenset(h.strip().lower().rstrip(".") for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            sent = dict(scope.get("headers") or ()).get(b"host", b"").decode("latin-1")
            if not host_allowed(sent, self.allowed):
                shown = sent[:100] if sent else "(none)"
                response = error_response(
                    f"the Host header {shown!r} does not name this server: reach it by IP address or localhost, "
                    "or start it with --allowed-host NAME for the name clients use", code="misdirected_request",
                    status_code=421)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (`uvicorn.Config(http=...)`) with a header timeout: a
    connection whose request headers are not whole `seconds` after it opened, or after its previous
    response ended, is closed. uvicorn's own timeouts do not cover it (`timeout_keep_alive` stops at
    the first byte of the next request)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if not seconds > 0:
        raise ValueError(f"header timeout {seconds}: give a positive number of seconds")

    class HeaderTimeout(AutoHTTPProtocol):
        header_timeout = seconds
        _header_timer = None
        _waited_cycle = None  # the request cycle current when the timer started: a new one = headers whole

        def _start_header_timer(self) -> None:
            self._stop_header_timer()
            self._waited_cycle = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_header_timer()

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waited_cycle:
                self._stop_header_timer()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request's cycle: its headers are whole
            if not self.transport.is_closing() and self.cycle is finished:
                self._start_header_timer()

    return HeaderTimeout
