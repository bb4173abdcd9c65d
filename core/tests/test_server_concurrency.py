"""`verispec serve` with many clients at once: the official `openai` client against uvicorn on a
loopback port, over the toy plugin's GGUF. Concurrent streaming requests (simultaneous and
staggered) each return exactly their solo greedy output; clients that leave mid-stream free
their slots; /metrics reports what runs. Every forward of the served engine takes 5 ms more,
so the requests really overlap."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai", reason="pip install openai (core's [test] extra)")
uvicorn = pytest.importorskip("uvicorn")

from verispec import api  # noqa: E402
from verispec.engine import SpecOptions  # noqa: E402
from verispec.registry import Registry  # noqa: E402
from verispec.server import create_app  # noqa: E402
from verispec.testing import toy_plugin  # noqa: E402
from verispec.testing.serving import serving, start_in_thread  # noqa: E402
from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf  # noqa: E402

CONTEXT = 256
PROMPTS = ["the cat sat on the mat. the cat", "a dog ran. a dog ran. a", "one two three one two",
           "red green blue red", "x y z x y z x", "hello there. hello", "mat cat hat bat", "sun moon star sun"]


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def served(model_path, registry):
    """(base_url, engine, batch sizes seen): uvicorn serving a slowed engine in a thread."""
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    forward, batch_sizes = engine.trunk.forward, []

    def slow_forward(batch):
        batch_sizes.append(len(batch))
        time.sleep(0.005)
        return forward(batch)
    engine.trunk.forward = slow_forward
    with serving(create_app(engine, model_name="toy")) as base_url:
        yield base_url, engine, batch_sizes


@pytest.fixture(scope="module")
def solo(model_path, registry):
    """The text each request gets alone from a fresh engine (chat for even i, completion for odd)."""
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    texts = []
    for i, prompt in enumerate(PROMPTS):
        engine.reset_cache()
        generation = engine.generate(_prompt(i), max_tokens=_max_tokens(i), ignore_eos=True)
        list(generation)
        texts.append(generation.result.text)
    return texts


def _prompt(i):
    return [{"role": "user", "content": PROMPTS[i]}] if i % 2 == 0 else PROMPTS[i]


def _max_tokens(i):
    return 10 + 3 * i


def _stream(base_url, i, delay_s=0.0):
    """Request i through the openai client, streamed; returns its concatenated text."""
    time.sleep(delay_s)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    common = dict(model="toy", max_tokens=_max_tokens(i), temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    if i % 2 == 0:
        chunks = client.chat.completions.create(messages=_prompt(i), **common)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chunks = client.completions.create(prompt=_prompt(i), **common)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _metrics(base_url) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


@pytest.mark.parametrize("num_clients", [1, 2, 4, 8])
@pytest.mark.parametrize("arrival", ["simultaneous", "staggered"])
def test_concurrent_streams_each_equal_their_solo_output(served, solo, num_clients, arrival):
    base_url, engine, batch_sizes = served
    del batch_sizes[:]
    delay = 0.03 if arrival == "staggered" else 0.0
    with ThreadPoolExecutor(num_clients) as pool:
        texts = list(pool.map(lambda i: _stream(base_url, i, delay * i), range(num_clients)))
    assert texts == solo[:num_clients]
    if num_clients > 1 and (arrival == "simultaneous" or num_clients == 8):  # 2 staggered may not overlap
        assert max(batch_sizes) > 1, batch_sizes  # they shared forwards
    metrics = _metrics(base_url)
    assert metrics["verispec_requests_running"] == 0 and metrics["verispec_requests_waiting"] == 0


def test_clients_that_leave_mid_stream_free_their_slots(served, solo):
    base_url, engine, _ = served
    before = _metrics(base_url)

    def leave_after_two_chunks(i):
        with httpx.stream("POST", f"{base_url}/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(2):
                next(line for line in lines if line.startswith("data: "))
        return True

    with ThreadPoolExecutor(20) as pool:
        assert all(pool.map(leave_after_two_chunks, range(20)))
    deadline = time.monotonic() + 30
    while (metrics := _metrics(base_url))["verispec_requests_running"] or metrics["verispec_requests_waiting"]:
        assert time.monotonic() < deadline, f"slots still held: {metrics}"
        time.sleep(0.1)
    assert metrics["verispec_requests_finished_total"] == before["verispec_requests_finished_total"] + 20
    generated = metrics["verispec_generated_tokens_total"] - before["verispec_generated_tokens_total"]
    assert 40 <= generated < 20 * 200  # each left long before its 200 tokens
    assert httpx.get(f"{base_url}/health", timeout=10).json()["status"] == "ok"
    assert _stream(base_url, 3) == solo[3]  # still serving, exactly


def test_metrics_is_prometheus_text(served):
    base_url, _, _ = served
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE verispec_generated_tokens_total counter" in r.text
    names = set(_metrics(base_url))
    assert {"verispec_requests_running", "verispec_requests_waiting", "verispec_generated_tokens_total",
            "verispec_acceptance_rate", "verispec_prefix_cache_hits_total"} <= names


def test_a_hundred_concurrent_streams_none_lost_none_mixed_up(served, model_path, registry):
    """100 streaming completions at once (16 decode, the rest queue): each gets its own prompt's
    solo text, and the server is healthy and idle afterwards."""
    import asyncio

    base_url, _, _ = served
    reference = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    expected = []
    for prompt in PROMPTS:
        generation = reference.generate(prompt, max_tokens=6, ignore_eos=True)
        list(generation)
        expected.append(generation.result.text)

    async def one(client, i):
        stream = await client.completions.create(model="toy", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(100)))
        finally:
            await client.close()

    texts = asyncio.run(all_of_them())
    assert texts == [expected[i % len(PROMPTS)] for i in range(100)]
    metrics = _metrics(base_url)
    assert metrics["verispec_requests_running"] == 0 and metrics["verispec_requests_waiting"] == 0
    assert httpx.get(f"{base_url}/health", timeout=10).json()["status"] == "ok"


def test_a_server_shutting_down_ends_running_streams_at_once(model_path, registry):
    """verispec.server.server(): when shutdown begins (should_exit, as Ctrl-C sets it), running
    and waiting generations end at their next token (finish_reason "length", then [DONE]), and
    the server stops within a second or two, not after the generations' 8 s."""
    from verispec.server import server as make_server

    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    forward = engine.trunk.forward
    engine.trunk.forward = lambda batch: (time.sleep(0.1), forward(batch))[1]
    server, thread, base_url = start_in_thread(
        lambda port: make_server(create_app(engine, model_name="toy"), host="127.0.0.1", port=port, log_level="error"))

    def stream(first_chunk: threading.Event):
        with httpx.stream("POST", f"{base_url}/v1/completions", timeout=30,
                          json={"prompt": PROMPTS[0], "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk.set()
        return lines

    firsts = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, first) for first in firsts]
        for first in firsts:
            assert first.wait(30)
        stopping = time.monotonic()
        server.should_exit = True
        thread.join(timeout=30)
        took = time.monotonic() - stopping
        results = [s.result(timeout=30) for s in streams]
    assert not thread.is_alive() and took < 3, f"took {took:.1f} s"
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        payloads = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert payloads[-2]["choices"][0]["finish_reason"] == "length"
        assert payloads[-1]["usage"]["completion_tokens"] < 40  # cut short: 80 were asked for
    assert not engine.has_work
