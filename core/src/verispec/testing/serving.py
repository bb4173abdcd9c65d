"""Servers for tests that talk HTTP: a uvicorn server on a free loopback port in a thread, and
waiting for a `verispec serve` subprocess to answer."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator


def free_port() -> int:
    """A loopback TCP port free now (bound once by the OS, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process, port: int, timeout: float = 60) -> None:
    """Poll /health on 127.0.0.1:`port` until the `verispec serve` subprocess `process` answers.
    Raises AssertionError with its output when it exits first, or after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"verispec serve did not answer within {timeout:.0f} s"
            time.sleep(0.2)


def start_in_thread(make_server: Callable[[int], object], *, start_timeout: float = 30.0):
    """(server, its thread, base URL): `make_server(port)` (a uvicorn.Server on 127.0.0.1:port)
    run on a free loopback port in a daemon thread, returned once it has started. Raises
    AssertionError when it has not started within `start_timeout` seconds."""
    port = free_port()
    server = make_server(port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serve `app` (create_app's) with a plain uvicorn.Server in a thread (start_in_thread);
    yields its base URL; stops it on exit."""
    import uvicorn

    server, thread, url = start_in_thread(
        lambda port: uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error")))
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
