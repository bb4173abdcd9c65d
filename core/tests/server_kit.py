"""What the server tests share (core/tests/test_server_*.py; their fixtures are in conftest.py):
the prompt and chat messages they send, the toy engine's context, the ASGI scope of a POST
/v1/completions, an SSE body's payloads, and uvicorn serving an app on a loopback port."""
import contextlib
import json
import time

from verispec.testing.serving import free_port

PROMPT = "the cat sat on the mat. the cat"
#: the ASGI scope of a POST /v1/completions, for tests that drive the app as a client that leaves.
COMPLETIONS_SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the cat?"}]
CONTEXT = 128


def sse_payloads(response) -> list:
    """The `data:` payloads of an SSE body, parsed; the [DONE] marker kept as a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [p if p == "[DONE]" else json.loads(p) for p in (line[len("data: "):] for line in lines)]


@contextlib.contextmanager
def uvicorn_thread(app):
    """uvicorn serving `app` on a free loopback port in a thread; yields the port."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
