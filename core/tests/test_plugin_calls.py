"""PluginCalls and the engine around it: a speculator call that hangs is abandoned after the
bound, or once a request's time limit passed, the speculator is switched off with one warning,
and the request finishes plainly (or ends at its time limit); a plugin's SystemExit or
KeyboardInterrupt never ends the process."""
import threading
import time

import pytest

from verispec import api
from verispec.engine import SpecOptions
from verispec.hookspecs import hookimpl
from verispec.plugin_calls import PLUGIN_CALL_GRACE_S, PluginCalls, PluginRaised, PluginTimeout
from verispec.registry import Registry
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import EchoSpeculator, write_toy_gguf

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def test_a_call_returns_its_result_and_raises_what_it_raised():
    calls = PluginCalls(5.0)
    assert calls(lambda a, b: a + b, 2, 3) == 5
    assert calls(threading.current_thread) is not threading.current_thread()  # on the worker
    with pytest.raises(ZeroDivisionError):
        calls(lambda: 1 / 0)

    def exits():
        raise SystemExit(3)
    with pytest.raises(PluginRaised, match="SystemExit: 3"):
        calls(exits)

    def interrupts():
        raise KeyboardInterrupt
    with pytest.raises(PluginRaised, match="KeyboardInterrupt"):
        calls(interrupts)
    assert calls(lambda: "still serving") == "still serving"


def test_a_hung_call_is_abandoned_at_the_bound_and_a_new_worker_serves_the_next():
    calls, release = PluginCalls(0.2), threading.Event()
    started = time.monotonic()
    with pytest.raises(PluginTimeout, match="did not return within 0.2 s"):
        calls(release.wait)
    assert time.monotonic() - started < 2.0 and calls.num_abandoned == 1
    assert calls(lambda: 7) == 7
    release.set()
    with pytest.raises(ValueError, match="positive"):
        PluginCalls(0)


def test_a_hung_call_is_abandoned_at_a_request_time_limit_before_the_bound():
    calls, release = PluginCalls(30.0), threading.Event()
    calls.deadline = (time.perf_counter() + 0.3, 0.3)  # a 0.3 s limit: the call still gets the grace
    started = time.monotonic()
    rule = r"ran past a request's time limit of 0.3 s \(waited 1 s\)"
    with pytest.raises(PluginTimeout, match=rule) as info:
        calls(release.wait)
    assert PLUGIN_CALL_GRACE_S - 0.05 <= time.monotonic() - started < PLUGIN_CALL_GRACE_S + 2.0
    assert info.value.rule.startswith("ran past") and calls.num_abandoned == 1
    calls.deadline = (time.perf_counter() + 60.0, 60.0)  # further off than the bound: the bound rules
    assert calls.wait() == (30.0, "did not return within 30 s")
    calls.deadline = None
    assert calls(lambda: 7) == 7
    release.set()


class Hanging(EchoSpeculator):
    """Drafts normally for a few steps, then one propose hangs for `hang_s` seconds."""

    hang_s = 60.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def propose(self, history, ctx):
        self.calls += 1
        if self.calls == 4:
            time.sleep(self.hang_s)
        return super().propose(history, ctx)


class HangingPlugin:
    def __init__(self, hang_s: float = 60.0):
        self.hang_s = hang_s

    @hookimpl
    def register_speculators(self, register):
        def factory(t, **kw):
            speculator = Hanging(kw["spec"], max_draft_tokens=kw["max_draft_tokens"])
            speculator.hang_s = self.hang_s
            return speculator
        register(SpeculatorSpec(name="hanging", summary="hangs in its 4th propose (test)",
                                can_arm_after_prefix_reuse=True, priority=10, factory=factory))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, seed=3)


def test_a_propose_that_never_returns_is_abandoned_and_the_request_finishes_plainly(model_path, caplog):
    registry = Registry.from_plugins({"toy": toy_plugin, "hanging": HangingPlugin()})
    plain = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    want = list(plain.generate(PROMPT, max_tokens=40, ignore_eos=True))
    engine = api.load(model_path, registry=registry, spec_type="hanging", adaptive=False)
    engine.plugin_calls.bound_s = 0.5
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="verispec"):
        generation = engine.generate(PROMPT, max_tokens=40, ignore_eos=True)
        got = list(generation)
    assert time.monotonic() - started < 20  # not the minute the plugin sleeps
    assert [e.token for e in got] == [e.token for e in want]
    result = generation.result
    assert result.reason.code == "faulted" and "did not return within 0.5 s" in result.reason.text
    assert sum("switched off for this engine" in r.getMessage() for r in caplog.records) == 1
    assert engine.speculator is None  # off for the engine: later requests decode plainly at once
    again = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
    list(again)
    assert again.result.reason.code == "faulted"


LIMIT_S, HANG_S = 0.5, 20.0  # a request's time limit, and how long the 4th propose sleeps (bound 30 s)


def test_a_request_time_limit_ends_it_while_a_propose_hangs(model_path, caplog):
    """The 4th propose sleeps 20 s, far past the request's 0.5 s limit and within the 30 s bound:
    the call is abandoned once the limit passed (and the grace), the speculator switched off
    with one warning naming the limit, and the request ends there, its tokens the plain ones."""
    registry = Registry.from_plugins({"toy": toy_plugin, "hanging": HangingPlugin(HANG_S)})
    plain = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    want = [e.token for e in plain.generate(PROMPT, max_tokens=400, ignore_eos=True)]
    engine = api.load(model_path, registry=registry, spec_type="hanging", adaptive=False)
    assert engine.plugin_calls.bound_s == 30.0
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="verispec"):
        generation = engine.generate(PROMPT, max_tokens=400, ignore_eos=True, time_limit=LIMIT_S)
        got = [e.token for e in generation]
    assert time.monotonic() - started < LIMIT_S + PLUGIN_CALL_GRACE_S + 2.0  # not the 20 s propose sleeps
    result = generation.result
    assert result.finish_reason == "length" and 1 <= len(got) < len(want) and got == want[:len(got)]
    assert result.reason.code == "faulted"
    assert "propose ran past a request's time limit of 0.5 s" in result.reason.text
    assert sum("switched off for this engine" in r.getMessage() for r in caplog.records) == 1


def test_the_server_request_timeout_ends_a_request_while_a_propose_hangs(model_path):
    """The same through the server's --request-timeout: the response comes once the limit (and
    the grace) passed, finish_reason "length", its text the plain text's start."""
    from fastapi.testclient import TestClient

    from verispec.server import create_app

    registry = Registry.from_plugins({"toy": toy_plugin, "hanging": HangingPlugin(HANG_S)})
    plain = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    generation = plain.generate(PROMPT, max_tokens=400, ignore_eos=True)
    list(generation)
    engine = api.load(model_path, registry=registry, spec_type="hanging", adaptive=False)
    client = TestClient(create_app(engine, model_name="toy", request_timeout=LIMIT_S))
    started = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                                             "ignore_eos": True})
    assert time.monotonic() - started < LIMIT_S + PLUGIN_CALL_GRACE_S + 2.0  # not the 20 s propose sleeps
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and 1 <= r.json()["usage"]["completion_tokens"] < 400
    assert generation.result.text.startswith(choice["text"])
    assert engine.speculator is None and "time limit of 0.5 s" in engine.fault


def test_health_says_503_while_one_engine_step_runs_past_its_bound(model_path):
    from fastapi.testclient import TestClient

    from verispec.server import create_app

    engine = api.load(model_path, registry=Registry.from_plugins({"toy": toy_plugin}), spec=SpecOptions(enabled=False))
    forward, stall = engine.trunk.forward, threading.Event()

    def stalling(batch):
        if stall.is_set():
            time.sleep(2.0)
        return forward(batch)
    engine.trunk.forward = stalling
    app = create_app(engine, model_name="toy")
    app.state.verispec.engine_thread.stuck_after_s = 0.5
    client = TestClient(app)
    assert client.get("/health").json()["status"] == "ok"
    stall.set()
    done = threading.Thread(target=lambda: client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0}))
    done.start()
    deadline, seen = time.monotonic() + 10, None
    while time.monotonic() < deadline and seen is None:
        r = client.get("/health")
        if r.status_code == 503:
            seen = r.json()
        time.sleep(0.1)
    stall.clear()
    done.join(30)
    assert seen is not None and seen["status"] == "unhealthy" and "stuck" in seen["detail"]
    assert client.get("/health").status_code == 200
