"""A tensor-parallel rank killed mid-request, through the engine and through `verispec serve --tp 2`:
the running requests fail with RankLost naming the rank and the fix, within the collective
timeout (VERISPEC_TP_TIMEOUT, short here), never a hang; the server answers them (503, or an
error event mid-stream) and then exits with status 1 naming the loss, so a supervisor restarts it.

Rank 0 is the engine (this process, or the `verispec serve` subprocess); rank 1 is the follower
it spawned, killed with SIGKILL as a crashed or OOM-killed rank would be.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import verispec
from verispec.engine import SpecOptions
from verispec.tensor_parallel import RankLost
from verispec.testing.serving import free_port, wait_until_serving

TIMEOUT_S = 5.0
#: the loss must surface within the collective timeout, plus this much for the step under way.
SLACK_S = 5.0
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch):
    monkeypatch.setenv("VERISPEC_TP_TIMEOUT", str(TIMEOUT_S))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_engine_requests_fail_with_rank_lost_within_the_timeout(tiny_fixture):
    _, path = tiny_fixture("qwen2")
    engine = verispec.load(path, dtype="fp32", tensor_parallel=2, spec=SpecOptions(enabled=False), kv_cache_gb=0)
    try:
        first = engine.generate(PROMPT, max_tokens=400, ignore_eos=True)
        second = engine.generate(PROMPT[::-1], max_tokens=400, ignore_eos=True)
        tokens = iter(first)
        for _ in range(3):
            next(tokens)
        (follower,) = engine.trunk._group.followers
        follower.kill()
        follower.wait()
        began = time.monotonic()
        with pytest.raises(RankLost, match=r"rank 1 \(killed by signal 9\) of 2 .*restart it"):
            list(tokens)
        assert time.monotonic() - began < TIMEOUT_S + SLACK_S
        with pytest.raises(RankLost):  # the request running beside it failed with it
            list(second)
        began = time.monotonic()
        with pytest.raises(RankLost):  # and a later one at once
            list(engine.generate(PROMPT, max_tokens=4))
        assert time.monotonic() - began < 1.0
    finally:
        engine.trunk.close()




def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found




def test_serve_answers_the_running_requests_then_exits_naming_the_lost_rank(tiny_fixture):
    _, path = tiny_fixture("qwen2")
    port = free_port()
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    server = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", path, "--port", str(port), "--tp", "2",
                               "--threads", "1", "--no-spec", "--dtype", "fp32"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(server, port, timeout=90)
        (follower,) = _children(server.pid)
        url = f"http://127.0.0.1:{port}/v1/completions"
        whole = {}
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(url, json=body, timeout=60)))
        waiting.start()
        with httpx.stream("POST", url, json={**body, "prompt": PROMPT[::-1], "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # a token came: it is running
            os.kill(follower, signal.SIGKILL)
            began = time.monotonic()
            last = [line for line in lines if line.startswith("data: ")][-1]
        assert time.monotonic() - began < TIMEOUT_S + SLACK_S
        error = json.loads(last.removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and "rank 1 (killed by signal 9) of 2" in error["message"]
        waiting.join(60)
        assert whole["r"].status_code == 503, whole["r"].text
        assert "restart it" in whole["r"].json()["error"]["message"]
        output, _ = server.communicate(timeout=TIMEOUT_S + SLACK_S)
        assert server.returncode == 1, output
        assert "verispec: error: rank 1 (killed by signal 9) of 2 tensor-parallel ranks stopped answering" in output
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_collective_timeout_that_is_not_a_positive_number_is_refused_naming_the_variable(monkeypatch, value):
    from verispec.errors import InvalidArgument
    from verispec.tensor_parallel import collective_timeout

    monkeypatch.setenv("VERISPEC_TP_TIMEOUT", value)
    with pytest.raises(InvalidArgument, match=f"VERISPEC_TP_TIMEOUT='{value}': give the seconds .* positive number"):
        collective_timeout()


def test_the_collective_timeout_comes_from_the_environment_or_the_default(monkeypatch):
    from verispec.tensor_parallel import DEFAULT_TIMEOUT_S, collective_timeout

    assert collective_timeout() == TIMEOUT_S
    monkeypatch.delenv("VERISPEC_TP_TIMEOUT")
    assert collective_timeout() == DEFAULT_TIMEOUT_S
