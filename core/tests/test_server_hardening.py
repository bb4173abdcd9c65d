"""The server's edges: the Host check against DNS rebinding, FastAPI's /docs
and /redoc off by default, the `bearer` scheme in any case, the header timeout for half-sent
headers, the port checked before the model loads, VERISPEC_API_KEY named over `--api-key KEY`,
and one line from a tensor-parallel follower that lost its group. Also the key on GET /v1/models
(a route once exempted from it passed every other test)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from verispec import api
from verispec.cli import main as cli_main
from verispec.cli.flags import build_parser
from verispec.engine import SpecOptions
from verispec.registry import Registry
from verispec.server import create_app, server
from verispec.server.connection import PortInUse, check_port, host_allowed
from verispec.testing import toy_plugin
from verispec.testing.serving import free_port, start_in_thread
from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf

KEY = "sk-hardening-7c1e"
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(model_path):
    return api.load(model_path, registry=Registry.from_plugins({"toy": toy_plugin}), context_length=128,
                    spec=SpecOptions(enabled=False))


@pytest.fixture
def served(engine):
    """serve(app, **kw) -> base URL of `server()` (verispec's uvicorn wrapper) on a loopback port."""
    running = []

    def start(app, **kw):
        srv, thread, url = start_in_thread(lambda port: server(app, host="127.0.0.1", port=port, log_level="error",
                                                                 **kw))
        running.append((srv, thread))
        return url
    yield start
    for srv, thread in running:
        srv.should_exit = True
        thread.join(timeout=30)


# -- the Host check ----------------------------------------------------------------------------

@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("127.0.0.1:8000", True), ("[::1]:8000", True), ("[::1]", True), ("10.1.2.3:80", True),
    ("localhost", True), ("LOCALHOST:8000", True), ("localhost.:8000", True), ("verispec.lan:8000", True),
    ("Verispec.LAN", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False), ("", False), ("[::1", False), ("verispec.lan.evil.example", False)])
def test_the_host_header_must_name_an_address_localhost_or_an_allowed_name(host, allowed):
    assert host_allowed(host, frozenset({"verispec.lan"})) is allowed
    assert host_allowed(host, frozenset({"*"})) is True


def test_a_dns_rebinding_host_is_refused_on_every_route_and_an_allowed_name_passes(engine, served):
    url = served(create_app(engine, model_name="toy"), allowed_hosts=["Verispec.LAN"])
    port = url.rsplit(":", 1)[1]
    for path in ("/", "/health", "/metrics", "/v1/models"):
        r = httpx.get(url + path, headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 421, path
        assert "--allowed-host" in r.json()["error"]["message"] and "attacker.example" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", headers={"Host": "attacker.example"},
                   json={"prompt": "the cat", "max_tokens": 2})
    assert r.status_code == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"verispec.lan:{port}"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(url + "/health").json()["status"] == "ok"  # httpx's own Host: the address


def test_serve_hands_the_allowed_hosts_and_docs_flag_to_the_server(engine, monkeypatch):
    from verispec.server import app as server_module

    built = []
    monkeypatch.setattr(server_module, "server", lambda app, host, port: type(
        "Bound", (), {"run": lambda self: built.append(app)})())
    server_module.serve(engine, allowed_hosts=["box.lan"], docs=True)
    (app,) = built
    assert app.state.allowed_hosts == ("box.lan",)
    assert TestClient(app).get("/docs").status_code == 200


def test_the_cli_passes_allowed_hosts_and_docs_to_serve(monkeypatch):
    from verispec.cli import main as main_module

    args = build_parser().parse_args(["serve", "--allowed-host", "a.lan", "--allowed-host", "b.lan", "--docs",
                                      "--port", "0"])
    assert args.allowed_host == ["a.lan", "b.lan"] and args.docs
    assert build_parser().parse_args(["serve"]).allowed_host == [] and not build_parser().parse_args(["serve"]).docs
    called = {}
    monkeypatch.setattr(main_module, "load_engine", lambda args: "engine")
    monkeypatch.setattr("verispec.server.serve", lambda engine, **kw: called.update(kw))
    assert main_module.cmd_serve(args) == 0
    assert called["allowed_hosts"] == ["a.lan", "b.lan"] and called["docs"] is True


# -- FastAPI's docs ----------------------------------------------------------------------------

def test_fastapis_docs_are_off_by_default_and_on_when_asked(engine):
    client = TestClient(create_app(engine, api_key=KEY))
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert client.get(path).status_code == 404, path
    client = TestClient(create_app(engine, docs=True))
    assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200


# -- the API key -------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(engine, scheme):
    client = TestClient(create_app(engine, model_name="toy", api_key=KEY))
    r = client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "toy"
    r = client.post("/v1/completions", headers={"Authorization": f"{scheme} {KEY}"},
                    json={"prompt": "the cat", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


@pytest.mark.parametrize("header", [None, f"Basic {KEY}", f"Bearer{KEY}", KEY, f"Bearer {KEY}x", "Bearer ",
                                    f"Token {KEY}", f"bearer {KEY.upper()}"])
def test_models_needs_the_key_like_every_v1_route(engine, header):
    client = TestClient(create_app(engine, model_name="toy", api_key=KEY))
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        r = client.request(method, path, headers=headers, json={"prompt": "x", "messages": []})
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health").status_code == 200


def test_the_readme_and_help_name_the_environment_variable_over_the_flag():
    text = " ".join(README.read_text().split())
    assert "VERISPEC_API_KEY=KEY verispec serve" in text
    assert "`--api-key KEY` does the same but shows the key to every user of the machine in `ps`" in text
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "$VERISPEC_API_KEY" in help_text and "ps" in help_text


# -- the header timeout ------------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (recv returns b""), or None if it was still open."""
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return time.monotonic() - began
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - began


def test_half_sent_headers_are_closed_at_the_header_timeout(engine, served):
    url = served(create_app(engine), header_timeout=0.5)
    port = int(url.rsplit(":", 1)[1])
    stalled = []
    for _ in range(20):  # a slowloris: many connections, each with half its headers
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        stalled.append(s)
    silent = socket.create_connection(("127.0.0.1", port))  # connected, nothing sent
    try:
        for s in [*stalled, silent]:
            took = _closed_within(s, 10.0)
            assert took is not None, "a connection with half-sent headers stayed open"
        assert httpx.get(url + "/health").status_code == 200  # the server itself is fine
    finally:
        for s in [*stalled, silent]:
            s.close()


def test_the_header_timeout_restarts_after_a_response_and_spares_a_slow_body(engine, served):
    url = served(create_app(engine), header_timeout=0.5)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request on the kept-alive connection stalls
        assert _closed_within(s, 10.0) is not None
    with socket.create_connection(("127.0.0.1", port)) as s:  # whole headers, the body 1 s later: served
        body = b'{"prompt": "the cat", "max_tokens": 2, "temperature": 0}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(1.0)
        s.sendall(body)
        s.settimeout(30)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# -- the port check ----------------------------------------------------------------------------

def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(monkeypatch, capsys):
    from verispec.cli import main as main_module

    loaded = []
    monkeypatch.setattr(main_module, "load_engine", lambda args: loaded.append(args))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}.*--port"):
            check_port("127.0.0.1", port)
        assert cli_main.main(["serve", "--port", str(port), "--no-spec"]) == 1
    err = capsys.readouterr().err
    assert loaded == [] and err.startswith(f"verispec: error: cannot serve on 127.0.0.1:{port}")
    assert len(err.strip().splitlines()) == 1
    check_port("127.0.0.1", port)  # free again
    check_port("127.0.0.1", 0)


# -- a tensor-parallel follower ----------------------------------------------------------------

def _toy_site(root) -> dict:
    info = root / "verispec_toy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verispec-toy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[verispec]\ntoy = verispec.testing.toy_plugin\n")
    return {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}


def test_a_follower_that_cannot_reach_rank_0_exits_1_with_one_line(tmp_path, model_path):
    env = {**_toy_site(tmp_path), "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-m", "verispec.tensor_parallel", str(model_path), "--world-size", "2",
                           "--timeout", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("verispec: error: ")]
    assert len(ours) == 1 and "rank 1 of 2 could not join" in ours[0], done.stderr


def test_a_lost_group_is_one_line_naming_the_rank(monkeypatch):
    import torch.distributed as dist

    from verispec.nn.parallel import Shards
    from verispec.tensor_parallel import Group, RankLost, follow

    def lost(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nException raised from recvBytes at "
                           "pair.cc:585\nframe #0: c10::Error::Error(...)")
    monkeypatch.setattr(dist, "broadcast_object_list", lost)
    with pytest.raises(RankLost) as raised:
        follow(object(), Group(Shards(1, 2), calls=None, timeout_s=1.0))
    assert str(raised.value) == "rank 1: lost the tensor-parallel group: Connection closed by peer [127.0.0.1]:29500"
