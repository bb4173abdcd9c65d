"""A uvicorn server on a free loopback port in a thread, for tests that talk HTTP to the app."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator


def start_in_thread(make_server: Callable[[int], object], *, start_timeout: float = 30.0):
    """(server, its thread, base URL): `make_server(port)` (a uvicorn.Server on 127.0.0.1:port)
    run on a free loopback port in a daemon thread, returned once it has started. Raises
    AssertionError when it has not started within `start_timeout` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
