"""The server's streams and the clients that leave them (verispec.server over the toy plugin's
GGUF): SSE chunks, stop strings and usage; a client that leaves mid-stream, times out or waits
past the request timeout frees the engine and leaves it exact; a drafter that raises mid-stream
never breaks a request; tokenising runs off the event loop."""
import json
import time

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient
from server_kit import COMPLETIONS_SCOPE, CONTEXT, MESSAGES, PROMPT, sse_payloads, uvicorn_thread

from verispec import api
from verispec.engine import SpecOptions
from verispec.registry import Registry
from verispec.server import create_app
from verispec.testing import toy_plugin
from verispec.testing.toy import write_toy_gguf


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_concatenate_to_the_non_streamed_text(client, chat):
    path, key = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")
    request = {key: MESSAGES if chat else PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    whole = client.post(path, json=request).json()
    r = client.post(path, json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    *chunks, finish, usage, done = sse_payloads(r)
    assert done == "[DONE]"
    if chat:
        assert chunks.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert finish["choices"][0]["delta"] == {}
        texts = [c["choices"][0]["delta"]["content"] for c in chunks]
        expected = whole["choices"][0]["message"]["content"]
    else:
        assert finish["choices"][0]["text"] == ""
        texts = [c["choices"][0]["text"] for c in chunks]
        expected = whole["choices"][0]["text"]
    assert "".join(texts) == expected
    assert len(chunks) == 20  # one chunk per token
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert len({c["id"] for c in (*chunks, finish, usage)}) == 1


def test_stream_without_include_usage_ends_with_finish_then_done(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    *chunks, finish, done = sse_payloads(r)
    assert len(chunks) == 3 and finish["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
    assert "usage" not in finish


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings_truncate_the_text_streamed_or_not(client, as_list):
    request = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    stop = full[10:13]
    request["stop"] = [stop, "never appears"] if as_list else stop
    body = client.post("/v1/completions", json=request).json()
    assert body["choices"][0] == {"index": 0, "text": full[:full.find(stop)], "logprobs": None,
                                  "finish_reason": "stop"}
    *chunks, finish, _ = sse_payloads(client.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert finish["choices"][0]["finish_reason"] == "stop"


def test_a_client_leaving_mid_stream_frees_the_engine_and_leaves_it_exact(tmp_path, registry):
    path = write_toy_gguf(tmp_path / "rec.gguf", vocab_size=110, recurrent=True, seed=5)
    app = create_app(api.load(path, registry=registry, spec=SpecOptions(enabled=False)))
    request = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    sent = []

    async def leave_after_three_tokens_then_ask_again():
        three_tokens = anyio.Event()
        body = [{"type": "http.request", "body": json.dumps({**request, "stream": True}).encode()}]

        async def receive():
            if body:
                return body.pop()
            await three_tokens.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent.append(message["body"])  # one token chunk each
                if len(sent) == 3:
                    three_tokens.set()
                    await anyio.sleep(0.5)  # the client leaves while the server is sending

        with anyio.fail_after(30):
            await app(dict(COMPLETIONS_SCOPE), receive, send)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            with anyio.fail_after(30):  # the engine is not held by the request that left
                return (await client.post("/v1/completions", json={**request, "max_tokens": 10})).json()

    got = anyio.run(leave_after_three_tokens_then_ask_again)
    assert len(sent) == 3
    fresh = api.load(path, registry=registry, spec=SpecOptions(enabled=False))
    generation = fresh.generate(PROMPT, max_tokens=10, ignore_eos=True)
    list(generation)
    assert got["choices"][0]["text"] == generation.result.text


def test_a_speculator_that_raises_mid_stream_never_breaks_a_request(model_path, registry, reference, caplog):
    """A third-party drafter whose propose raises after a few good steps: the stream still ends
    with a finish reason and [DONE], the text is the plain text, one warning names it, and the
    engine decodes plainly from then on."""
    from verispec.hookspecs import hookimpl
    from verispec.specs import SpeculatorSpec
    from verispec.testing.toy import ScriptedSpeculator

    calls = []

    def script(ctx):
        calls.append(ctx.pos)
        if len(calls) > 2:
            raise RuntimeError("drafter bug")
        return [ctx.last_token] * ctx.max_draft_tokens

    class Faulty:
        @hookimpl
        def register_speculators(self, register):
            register(SpeculatorSpec(name="faulty", summary="raises (test)", priority=99,
                                    factory=lambda trunk, **kw: ScriptedSpeculator(script, spec=kw["spec"])))

    faulty_registry = Registry.from_plugins({"toy": toy_plugin, "faulty": Faulty()})
    engine = api.load(model_path, registry=faulty_registry, context_length=CONTEXT, spec_type="faulty",
                      adaptive=False)
    client = TestClient(create_app(engine, model_name="toy"))
    with caplog.at_level("WARNING", logger="verispec"):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                 "ignore_eos": True, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]" and payloads[-3]["choices"][0]["finish_reason"] == "length"
    stats = next(p["verispec"] for p in payloads[:-1] if "verispec" in p)
    assert stats["speculator"] == "faulty" and "drafter bug" in stats["speculator_fault"]
    expected, _ = reference(PROMPT, max_tokens=12, ignore_eos=True)
    assert "".join(p["choices"][0]["text"] for p in payloads[:-2]) == expected.text
    faults = [rec for rec in caplog.records if "drafter bug" in rec.getMessage()]
    assert len(faults) == 1 and "'faulty'" in faults[0].getMessage() and "this engine" in faults[0].getMessage()
    assert engine.speculator is None and "drafter bug" in engine.fault
    again = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected.text
    assert again.json()["verispec"]["speculator"] is None  # off for the engine: plain, and said so
    assert len(calls) == 3  # never asked again


def test_a_whole_response_whose_client_left_stops_and_frees_the_engine(slow_engine, reference):
    app = create_app(slow_engine)
    request = {"prompt": PROMPT, "max_tokens": 90, "temperature": 0, "ignore_eos": True}
    sent = []

    async def leave_after_five_forwards_then_ask_again():
        body = [{"type": "http.request", "body": json.dumps(request).encode()}]

        async def receive():
            if body:
                return body.pop()
            while slow_engine.forwards < 5:
                await anyio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        with anyio.fail_after(30):
            await app(dict(COMPLETIONS_SCOPE), receive, send)
        left_at = slow_engine.forwards
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            with anyio.fail_after(30):
                answer = (await client.post("/v1/completions", json={**request, "max_tokens": 10})).json()
        return left_at, answer

    left_at, answer = anyio.run(leave_after_five_forwards_then_ask_again)
    assert sent[0]["status"] == 200
    assert 5 <= left_at < 45  # the step under way finished; 90 forwards were asked for
    expected, _ = reference(PROMPT, max_tokens=10, ignore_eos=True)
    assert answer["choices"][0]["text"] == expected.text  # the abandoned request left the engine exact


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_past_the_request_timeout_ends_with_finish_reason_length(slow_engine, reference, stream):
    client = TestClient(create_app(slow_engine, request_timeout=0.2))
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 90, "temperature": 0,
                                             "ignore_eos": True, "stream": stream,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    if stream:
        payloads = sse_payloads(r)
        assert payloads[-1] == "[DONE]" and payloads[-3]["choices"][0]["finish_reason"] == "length"
        text = "".join(p["choices"][0]["text"] for p in payloads[:-3])
        n = payloads[-2]["usage"]["completion_tokens"]
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        text, n = choice["text"], r.json()["usage"]["completion_tokens"]
    assert 1 <= n < 50  # each token takes >= 20 ms: 0.2 s hold about 10
    expected, _ = reference(PROMPT, max_tokens=n, ignore_eos=True)
    assert text == expected.text  # cut at a token, as max_tokens=n would
    again = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                 "ignore_eos": True})
    assert again.json()["choices"][0]["text"] == reference(PROMPT, max_tokens=3, ignore_eos=True)[0].text


def test_over_a_real_socket_a_client_that_times_out_stops_its_generation(slow_engine, reference):
    """uvicorn on a loopback port: a non-streaming client gives up after 0.3 s; its generation
    ends at the next token (far fewer than its 90 forwards run), and the next client's 5 tokens
    come right after (no forward of the abandoned request runs meanwhile)."""
    with uvicorn_thread(create_app(slow_engine)) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        request = {"prompt": PROMPT, "max_tokens": 90, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=request, timeout=0.3)
        left_at, settle_by = -1, time.monotonic() + 30
        while slow_engine.forwards != left_at:  # the step under way ends, the disconnect is seen
            left_at = slow_engine.forwards
            time.sleep(0.3)
            assert time.monotonic() < settle_by
        assert left_at < 45
        r = httpx.post(url, json={**request, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and slow_engine.forwards - left_at <= 6  # prefill + 4 decodes (+1 spare)
        assert r.json()["choices"][0]["text"] == reference(PROMPT, max_tokens=5, ignore_eos=True)[0].text


def test_tokenising_runs_off_the_event_loop(engine, monkeypatch):
    """While one request's prompt is being encoded (here: held on an Event), /health answers;
    encoding on the event loop would hold every request until it finished."""
    import threading

    entered, release, held_too_long = threading.Event(), threading.Event(), []
    encode = engine.encode

    def held_encode(prompt, **kwargs):
        entered.set()
        if not release.wait(5):
            held_too_long.append(True)
        return encode(prompt, **kwargs)
    monkeypatch.setattr(engine, "encode", held_encode)
    app = create_app(engine, model_name="toy")

    async def health_while_encoding():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            async with anyio.create_task_group() as group:
                answers = {}

                async def complete():
                    answers["completion"] = await client.post("/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
                group.start_soon(complete)
                with anyio.fail_after(10):
                    while not entered.is_set():
                        await anyio.sleep(0.01)
                    answers["health"] = await client.get("/health")
                release.set()
        return answers

    answers = anyio.run(health_while_encoding)
    assert answers["health"].status_code == 200 and not held_too_long  # answered while encode was held
    assert answers["completion"].status_code == 200
