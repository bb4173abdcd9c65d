"""The real `verispec serve` process on a free localhost port (the toy plugin installed through an
on-disk dist-info): it answers, warns when it listens beyond loopback without a key, names the
extra without fastapi, and stops at once mid-stream on Ctrl-C or SIGTERM."""
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_kit import MESSAGES, PROMPT

from verispec.testing.serving import free_port, wait_until_serving
from verispec.testing.terminal import default_sigint


def _toy_site(root) -> dict:
    """An environment in which the toy plugin is installed (an on-disk dist-info folder)."""
    info = root / "verispec_toy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verispec-toy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[verispec]\ntoy = verispec.testing.toy_plugin\n")
    return {**os.environ, "PYTHONPATH": str(root)}


def test_verispec_serve_answers_on_localhost(tmp_path, model_path):
    port = free_port()
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", str(model_path), "--port", str(port),
                                "--no-spec", "--request-timeout", "30"], env=_toy_site(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(process, port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["model"] == str(model_path)
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("host, warned", [
    ("127.0.0.1", False), ("127.0.0.2", False), ("::1", False), ("[::1]", False), ("localhost", False),
    ("0.0.0.0", True), ("::", True), ("192.168.1.20", True), ("example.com", True)])
def test_serving_beyond_loopback_without_a_key_warns_naming_the_flag(engine, monkeypatch, capsys, host, warned):
    from verispec.server import app as server_module

    bound = []
    monkeypatch.setattr(server_module, "server", lambda app, host, port: type(
        "Bound", (), {"run": lambda self: bound.append((host, port))})())
    server_module.serve(engine, host=host, port=8123)
    err = capsys.readouterr().err
    assert bound == [(host, 8123)]
    if warned:
        assert err.startswith(f"verispec: warning: serving on {host}:8123, ") and "--api-key" in err
        assert len(err.splitlines()) == 1
    else:
        assert err == ""
    server_module.serve(engine, host=host, port=8123, api_key="k")  # a key: no warning on any host
    assert capsys.readouterr().err == ""


def test_verispec_serve_without_fastapi_names_the_extra(monkeypatch, capsys):
    import verispec.cli.main as cli

    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi -> ImportError
    for name in [m for m in sys.modules if m == "verispec.server" or m.startswith("verispec.server.")]:
        monkeypatch.delitem(sys.modules, name)
    assert cli.main(["serve"]) == 2
    assert "pip install 'fastapi>=0.110' 'uvicorn>=0.29'" in capsys.readouterr().err


def _slow_toy_serve(port: int, seconds_per_forward: float) -> list[str]:
    """argv running `verispec serve` on the toy model whose every forward takes longer."""
    code = ("import sys, time; from verispec.cli.main import main; from verispec.testing.toy import ToyTrunk\n"
            "forward = ToyTrunk.forward\n"
            f"ToyTrunk.forward = lambda self, batch: (time.sleep({seconds_per_forward}), forward(self, batch))[1]\n"
            "sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("signals", [("SIGINT",), ("SIGINT", "SIGINT"), ("SIGTERM",)])
def test_verispec_serve_stops_at_once_mid_stream(tmp_path, model_path, signals):
    """Ctrl-C (once or twice) or SIGTERM during a long stream: the stream ends at its next token
    with finish_reason "length" and [DONE], and the process exits within seconds, without a
    traceback (Ctrl-C: one line and exit status 130; SIGTERM: ended by that signal)."""
    import signal

    port = free_port()
    process = subprocess.Popen(_slow_toy_serve(port, 0.1) + ["serve", "--model", str(model_path), "--port", str(port),
                                                             "--no-spec"],
                               env=_toy_site(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint)
    try:
        wait_until_serving(process, port)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:  # 80 forwards of 0.1 s: 8 s
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            head = [next(lines) for _ in range(2)]
            signalled = time.monotonic()
            for sig in signals:
                process.send_signal(getattr(signal, sig))
                time.sleep(0.05)
            rest = list(lines)
        _, stderr = process.communicate(timeout=20)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    payloads = [json.loads(line[len("data: "):]) for line in head + rest[:-1]]
    assert rest[-1] == "data: [DONE]" and payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len(payloads) < 40  # cut short: 80 tokens were asked for
    assert took < 5, f"took {took:.1f} s to stop"
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    if signals[0] == "SIGINT":
        assert process.returncode == 130 and stderr.rstrip().endswith("verispec: interrupted"), stderr
    else:
        assert process.returncode == -signal.SIGTERM, (process.returncode, stderr)
