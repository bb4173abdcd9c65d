"""Why a request speculated or not (verispec.reasons), through the server: one test per reason
code, each reading the `verispec.reason` of a response (or a stream's last chunk) from a
TestClient over the toy GGUF, and /metrics counting requests by reason."""
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from verispec import api
from verispec.cost_model import COLD_PROPOSE_CALLS
from verispec.engine import InferenceEngine, SpecOptions
from verispec.hookspecs import hookimpl
from verispec.reasons import REASON_CODES
from verispec.registry import Registry
from verispec.seams import DrafterMismatch
from verispec.server import create_app
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import CHAT_TEMPLATE, EchoSpeculator, ScriptedSpeculator, write_toy_gguf

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
CONTEXT = 256


class Speculators:
    """Test speculators: echo (a 1-gram lookup), echo-no-reuse (cannot arm after prefix reuse),
    slow (an echo that sleeps in propose), faulty (raises)."""

    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="echo", summary="1-gram echo (test)",
                                factory=lambda trunk, **kw: EchoSpeculator(kw["spec"], max_draft_tokens=4)))
        register(SpeculatorSpec(name="echo-no-reuse", summary="echo that cannot arm after reuse (test)",
                                can_arm_after_prefix_reuse=False,
                                factory=lambda trunk, **kw: EchoSpeculator(kw["spec"], max_draft_tokens=4)))
        register(SpeculatorSpec(name="slow", summary="echo that sleeps 30 ms per draft (test)",
                                factory=lambda trunk, **kw: SlowEcho(kw["spec"], max_draft_tokens=4)))
        register(SpeculatorSpec(name="faulty", summary="raises in propose (test)",
                                factory=lambda trunk, **kw: ScriptedSpeculator(_raise, spec=kw["spec"])))


class Mismatched:
    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="mismatched", summary="bound to another trunk (test)", factory=_mismatched))


class SlowEcho(EchoSpeculator):
    def propose(self, history, ctx):
        time.sleep(0.03)
        return super().propose(history, ctx)


def _raise(ctx):
    raise RuntimeError("drafter bug")


class Tapping:
    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="deep-taps", summary="reads layer 99 (test)", needs_hidden_state=True,
                                factory=lambda trunk, **kw: ScriptedSpeculator(lambda ctx: [], spec=kw["spec"],
                                                                               tap_layers=(1, 99))))


def _mismatched(trunk, **kw):
    raise DrafterMismatch("hidden size 64 != trunk hidden size 16; use a drafter trained for this trunk")


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin, "speculators": Speculators()})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)


def serve(model_path, registry, spec_type="echo", trunk=None, **options):
    spec = SpecOptions(enabled=False) if spec_type == "none" else SpecOptions(spec_type=spec_type, **options)
    if trunk is not None:
        engine = InferenceEngine(trunk, registry=registry, spec=spec)
    else:
        engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=spec)
    return TestClient(create_app(engine, model_name="toy"))


def complete(client, prompt=PROMPT, max_tokens=24, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["verispec"]["reason"]


def reason_counts(client) -> dict[str, int]:
    lines = [line for line in client.get("/metrics").text.splitlines()
             if line.startswith("verispec_requests_by_reason_total{")]
    return {line.split('"')[1]: int(line.rsplit(" ", 1)[1]) for line in lines}


def test_armed_names_the_counts_and_the_last_stream_chunk_carries_it(model_path, registry):
    client = serve(model_path, registry, adaptive=False)
    reason = complete(client)
    assert reason["code"] == "armed" and "'echo'" in reason["text"] and "accepted" in reason["text"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                  "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                  "stream": True})
    chunks = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: {")]
    last = json.loads(chunks[-1])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["verispec"]["reason"]["code"] == "armed" and last["verispec"]["num_draft_tokens"] > 0
    info = last["verispec"]  # vLLM's spec-decode metric names
    per_pos = info["num_accepted_tokens_per_pos"]
    assert sum(per_pos) == info["num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert info["mean_acceptance_length"] == pytest.approx(1 + info["num_accepted_tokens"] / info["num_drafts"])
    counts = reason_counts(client)
    assert set(counts) == set(REASON_CODES) and counts["armed"] == 2 and sum(counts.values()) == 2
    metrics = client.get("/metrics").text
    first_pos = [line for line in metrics.splitlines()
                 if line.startswith('verispec_accepted_tokens_per_pos_total{position="0"}')]
    assert first_pos and int(first_pos[0].rsplit(" ", 1)[1]) >= per_pos[0]


def test_measuring_then_parked_by_a_slow_drafter(model_path, registry):
    client = serve(model_path, registry, spec_type="slow")
    first = complete(client, max_tokens=3)  # the bootstrap: plain steps timing the baseline
    assert first["code"] == "measuring", first
    # the probe: its first COLD_PROPOSE_CALLS calls are not judged (cold), the next drafts too slowly: it loses
    probed = complete(client, max_tokens=COLD_PROPOSE_CALLS + 8)
    assert "parked" in probed["text"], probed
    parked = complete(client, max_tokens=8)  # the whole request inside the park
    assert parked["code"] == "parked" and "before the park" not in parked["text"], parked
    assert "rule 12: propose took" in parked["text"] and "more tokens" in parked["text"]  # the rule that parked it
    assert reason_counts(client)["parked"] >= 1


def test_too_short_when_a_request_cannot_decode_two_tokens(model_path, registry):
    client = serve(model_path, registry, adaptive=False)
    assert complete(client, max_tokens=1)["code"] == "too_short"


@pytest.mark.parametrize("plugin, words", [
    (None, ["toy-block", "draft head"]),  # the toy registry's block drafter needs a draft head
    (Mismatched, ["mismatched", "hidden size 64 != trunk hidden size 16"]),  # its factory refuses the trunk
    (Tapping, ["deep-taps asks for hidden taps the trunk cannot serve", "got [99]"]),
])
def test_declined_carries_the_registrys_reason(model_path, plugin, words):
    plugins = {"toy": toy_plugin, **({"extra": plugin()} if plugin else {})}
    client = serve(model_path, Registry.from_plugins(plugins), "auto")
    reason = complete(client)
    assert reason["code"] == "declined"
    assert all(word in reason["text"] for word in words), reason


def test_declined_when_the_trunk_refuses(model_path, registry):
    trunk = api.load_registered_trunk(model_path, registry)
    trunk.speculation_refusal = "verify rows differ from decode rows"
    reason = complete(serve(model_path, registry, spec_type="auto", trunk=trunk))
    assert reason["code"] == "declined" and "the trunk refuses speculation: verify rows differ" in reason["text"]


def test_off_for_the_server_and_for_one_request_with_the_same_text(model_path, registry):
    assert complete(serve(model_path, registry, spec_type="none"))["code"] == "off"
    client = serve(model_path, registry, adaptive=False)
    on = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                              "ignore_eos": True}).json()
    off = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                               "ignore_eos": True, "verispec": {"speculation": False}}).json()
    assert on["verispec"]["reason"]["code"] == "armed" and off["verispec"]["reason"]["code"] == "off"
    assert off["verispec"]["num_draft_tokens"] == 0 and off["choices"][0]["text"] == on["choices"][0]["text"]
    bad = client.post("/v1/completions", json={"prompt": PROMPT, "verispec": {"speculation": "no"}})
    assert bad.status_code == 400 and "speculation" in bad.text


def test_faulted_names_the_plugin_for_that_request_and_the_next(model_path, registry):
    client = serve(model_path, registry, spec_type="faulty", adaptive=False)
    first, second = complete(client), complete(client)
    assert first["code"] == second["code"] == "faulted"
    assert "'faulty'" in first["text"] and "drafter bug" in first["text"] and "drafter bug" in second["text"]


def test_unarmed_on_a_reused_prefix_for_a_speculator_that_cannot_arm_after_reuse(model_path, registry):
    client = serve(model_path, registry, spec_type="echo-no-reuse", adaptive=False)
    first = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                 "ignore_eos": True}).json()
    assert first["verispec"]["reason"]["code"] == "armed"
    again = client.post("/v1/completions", json={"prompt": PROMPT + first["choices"][0]["text"], "max_tokens": 12,
                                                 "temperature": 0, "ignore_eos": True}).json()
    assert again["verispec"]["reused_prefix_tokens"] > 0
    assert again["verispec"]["reason"]["code"] == "unarmed", again["verispec"]


def test_requests_that_never_run_alone_draft_in_the_batch(model_path, registry):
    """Two requests submitted before the engine steps: they prefill and decode in one batch until
    the shorter ends; both drafted (the batched plan), and both say so."""
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec_type="echo", adaptive=False)
    with engine.scheduler.step_lock:  # hold the engine thread off until both are queued
        client = TestClient(create_app(engine, model_name="toy"))
        results = {}

        def post(name, max_tokens):
            results[name] = complete(client, max_tokens=max_tokens)
        threads = [threading.Thread(target=post, args=("short", 6)), threading.Thread(target=post, args=("long", 30))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while engine.scheduler.num_waiting < 2:
            assert time.monotonic() < deadline, "the requests did not arrive"
            time.sleep(0.01)
    for thread in threads:
        thread.join(60)
    assert results["short"]["code"] == "armed" and "'echo' drafted" in results["short"]["text"]
    assert results["long"]["code"] == "armed"
