"""The OpenAI-compatible server (verispec.server) over the toy plugin's GGUF, through
fastapi.testclient (no socket); expected outputs come from the engine called directly.
One test runs the real `verispec serve` process on a free localhost port."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient

from verispec import api
from verispec.engine import SpecOptions
from verispec.registry import Registry
from verispec.sampling import SamplingParams
from verispec.server import create_app
from verispec.testing import toy_plugin
from verispec.testing.terminal import default_sigint
from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf
from verispec.testing.serving import free_port, wait_until_serving

PROMPT = "the cat sat on the mat. the cat"
#: the ASGI scope of a POST /v1/completions, for tests that drive the app as a client that leaves.
COMPLETIONS_SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the cat?"}]
CONTEXT = 128


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(model_path, registry):
    return api.load(model_path, registry=registry, context_length=CONTEXT)


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(engine, model_name="toy"))


@pytest.fixture(scope="module")
def reference(model_path, registry):
    """A second engine on the same file: what the server should answer."""
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))

    def run(prompt, **kw):
        generation = engine.generate(prompt, **kw)
        events = list(generation)
        return generation.result, events
    run.engine = engine
    return run


def sse_payloads(response) -> list:
    """The `data:` payloads of an SSE body, parsed; the [DONE] marker kept as a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [p if p == "[DONE]" else json.loads(p) for p in (line[len("data: "):] for line in lines)]


def test_completion_equals_the_engine_with_usage_and_finish_reason(client, reference):
    r = client.post("/v1/completions", json={"model": "anything", "prompt": PROMPT, "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected, _ = reference(PROMPT, max_tokens=12, ignore_eos=True)
    assert body["object"] == "text_completion" and body["model"] == "toy" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": 12,
                             "total_tokens": expected.prompt_tokens + 12}


def test_token_id_prompt_equals_the_text_prompt(client, reference):
    ids = reference.engine.encode(PROMPT)
    text = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == text["choices"][0]["text"]
    assert by_ids["usage"] == text["usage"]


def test_a_repeated_prompt_reuses_the_cached_prefix(client):
    request = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = client.post("/v1/completions", json=request).json()
    second = client.post("/v1/completions", json=request).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["verispec"]["reused_prefix_tokens"] == second["usage"]["prompt_tokens"] - 1


def test_chat_completion_renders_the_chat_template(client, reference):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    expected, _ = reference(MESSAGES, max_tokens=10)
    rendered = reference.engine.tokenizer.render_chat(MESSAGES)
    assert rendered.startswith("<system>be brief\n<user>where is the cat?\n") and rendered.endswith("<assistant>")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert body["choices"][0]["finish_reason"] == expected.finish_reason
    assert body["usage"]["prompt_tokens"] == len(reference.engine.encode(MESSAGES))


def test_chat_accepts_text_content_parts_and_max_completion_tokens(client, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "where is "}, {"type": "text", "text": "the cat?"}]}]
    body = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 5,
                                                     "max_tokens": 50, "temperature": 0, "ignore_eos": True}).json()
    expected, _ = reference([{"role": "user", "content": "where is the cat?"}], max_tokens=5, ignore_eos=True)
    assert body["choices"][0]["message"]["content"] == expected.text and body["usage"]["completion_tokens"] == 5


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


def test_seeded_sampling_is_reproducible_across_requests_and_equals_the_engine(client, reference):
    request = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.5, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
               "seed": 1234, "frequency_penalty": 0.2, "presence_penalty": 0.1, "repetition_penalty": 1.1,
               "ignore_eos": True}
    first, second = (client.post("/v1/completions", json=request).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    params = SamplingParams(temperature=1.5, top_p=0.95, top_k=40, min_p=0.01, seed=1234, frequency_penalty=0.2,
                            presence_penalty=0.1, repetition_penalty=1.1)
    expected, _ = reference(PROMPT, max_tokens=24, sampling=params, ignore_eos=True)
    assert first["choices"][0]["text"] == expected.text


def test_completion_logprobs_are_the_engines_draws(client, reference):
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                "logprobs": 3, "ignore_eos": True}).json()
    logprobs = body["choices"][0]["logprobs"]
    _, events = reference(PROMPT, max_tokens=6, sampling=SamplingParams(logprobs=3), ignore_eos=True)
    decode = reference.engine.tokenizer.decode
    assert logprobs["tokens"] == [decode([e.token], skip_special=False) for e in events]
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in events])
    assert [len(top) for top in logprobs["top_logprobs"]] == [3] * 6
    for top, e in zip(logprobs["top_logprobs"], events):
        assert max(top.values()) == pytest.approx(e.logprob)  # greedy: the drawn token is the likeliest
    offsets = [sum(len(x.text) for x in events[:i]) for i in range(6)]
    assert logprobs["text_offset"] == offsets


def test_chat_logprobs_streamed_and_whole(client, reference):
    request = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2,
               "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=request).json()["choices"][0]["logprobs"]["content"]
    _, events = reference(MESSAGES, max_tokens=5, sampling=SamplingParams(logprobs=2), ignore_eos=True)
    assert [entry["logprob"] for entry in whole] == pytest.approx([e.logprob for e in events])
    for entry, e in zip(whole, events):
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp for _, lp in e.top_logprobs])
        assert entry["bytes"] == list(entry["token"].encode())
    chunks = sse_payloads(client.post("/v1/chat/completions", json={**request, "stream": True}))[1:-2]
    assert [c["choices"][0]["logprobs"]["content"][0] for c in chunks] == whole
    without = client.post("/v1/chat/completions", json={**request, "logprobs": False, "top_logprobs": None}).json()
    assert without["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,request_body", [
    ("/v1/completions", {"prompt": "x" * 200}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}),
])
def test_a_prompt_longer_than_the_context_is_a_400_naming_the_fix(client, path, request_body):
    r = client.post(path, json=request_body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "shorten the prompt" in error["message"] and f"holds {CONTEXT}" in error["message"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == ("prompt" if "prompt" in request_body else "messages")


@pytest.mark.parametrize("trained, hint", [(None, "shorten the prompt"), (CONTEXT, "whole trained length"),
                                           (4 * CONTEXT, f"larger --context-length, up to {4 * CONTEXT}")])
def test_the_context_400_suggests_a_larger_context_only_where_the_model_has_one(client, engine, monkeypatch,
                                                                                trained, hint):
    monkeypatch.setattr(engine.trunk, "trained_context_length", trained, raising=False)
    message = client.post("/v1/completions", json={"prompt": "x" * 200}).json()["error"]["message"]
    assert hint in message
    assert ("--context-length" in message) == (trained != CONTEXT)


@pytest.mark.parametrize("path,request_body,message", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature=-1.0: must be in [0, inf); use 0 for greedy"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p=0.0: must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature: Input should be a valid number"),
    ("/v1/completions", {"temperature": 0}, "prompt: Field required"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens=0: ask for at least 1 token"),
    ("/v1/completions", {"prompt": ""}, "empty prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": [5, 110]}, "[110] lie outside the vocabulary [0, 110)"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", ""]}, "stop strings must be non-empty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs: Input should be less than or equal to 5"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of is not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo is not supported"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias is not supported"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools is not supported"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}},
     "response_format is not supported"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 'top_logprobs needs "logprobs": true'),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
     "top_logprobs: Input should be less than or equal to 20"),
    ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text content parts"),
])
def test_rejected_requests_are_400_with_an_openai_error(client, path, request_body, message):
    r = client.post(path, json={"max_tokens": 2, **request_body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
                                          ("min_p", 2), ("frequency_penalty", 3), ("presence_penalty", -2.5),
                                          ("repetition_penalty", 0)])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_sampling_value_out_of_range_is_a_400_naming_its_field(client, path, field, value):
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = client.post(path, json={**prompt, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    shown = value if field == "top_k" else float(value)  # SamplingParams' converters
    assert error["param"] == field and f"{field}={shown!r}" in error["message"], error


def test_a_model_without_a_chat_template_refuses_chat_requests(tmp_path, registry):
    engine = api.load(write_toy_gguf(tmp_path / "plain.gguf", vocab_size=110), registry=registry)
    r = TestClient(create_app(engine)).post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400 and "has no tokenizer.chat_template" in r.json()["error"]["message"]


@pytest.mark.parametrize("template, status, kind, message", [
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", 500, "server_error",
     "the model's chat template failed: syntax error at line 2: unexpected '}'; fix tokenizer.chat_template"),
    ("{{ 'x' * 10**10 }}", 500, "server_error", "'*' would build a value longer than 16777216 characters"),
    ("{{ raise_exception('one turn only') }}", 400, "invalid_request_error",
     "the chat template refused these messages: one turn only; change the messages"),
])
def test_a_failing_chat_template_answers_its_status_naming_it(tmp_path, registry, template, status, kind,
                                                              message):
    path = write_toy_gguf(tmp_path / "broken.gguf", vocab_size=110, chat_template=template)
    client = TestClient(create_app(api.load(path, registry=registry)), raise_server_exceptions=False)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == kind and error["param"] == "messages", error


def test_models_and_health(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["toy"]
    assert client.get("/health").json() == {"status": "ok", "speculator": None}


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


# -- the real process --------------------------------------------------------------------------





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


# -- hostile input and held engines ---------------------------------------------------------------

@pytest.mark.parametrize("path,request_body,field", [
    ("/v1/completions", {"prompt": "caf\ud800 au lait"}, "prompt"),
    ("/v1/chat/completions", {"messages": [MESSAGES[0], {"role": "user", "content": "caf\udce9"}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "us\ud800er", "content": "hi"}]}, "messages[0].role"),
    ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "a\ud83d"]}, "stop[1]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, request_body, field):
    body = json.dumps({"max_tokens": 2, **request_body})  # ensure_ascii: the surrogate travels as \\ud800
    assert "\\ud" in body
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: a lone surrogate U+") and "not Unicode text" in error["message"]
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_max_tokens_beyond_what_the_context_holds_is_a_400_naming_the_limit(client, engine):
    room = CONTEXT - len(engine.encode(PROMPT))
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10**9})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"holds {CONTEXT} tokens" in error["message"] and f"at most {room}" in error["message"]
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": room + 1}).status_code == 400
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": room, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room
    chat_room = CONTEXT - len(engine.encode(MESSAGES))
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": chat_room + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert f"at most {chat_room}" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": chat_room + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -3), ("max_completion_tokens", 0)])
def test_a_max_tokens_below_one_is_a_400_naming_the_field(client, field, value):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and f"{field}={value}" in error["message"]


def test_the_completions_default_max_tokens_fits_a_nearly_full_context(client, engine):
    """16 tokens is OpenAI's default, not the client's ask: it shrinks to what fits."""
    prompt = PROMPT + " the cat" * 100
    ids = engine.encode(prompt)
    prompt = engine.tokenizer.decode(ids[:CONTEXT - 5])
    room = CONTEXT - len(engine.encode(prompt))
    assert 0 < room < 16
    r = client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room


@pytest.fixture
def slow_engine(model_path, registry):
    """An engine whose every forward takes 20 ms more: `engine.forwards` counts them."""
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    forward = engine.trunk.forward
    engine.forwards = 0

    def slow_forward(*args, **kwargs):
        engine.forwards += 1
        time.sleep(0.02)
        return forward(*args, **kwargs)
    engine.trunk.forward = slow_forward
    return engine


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


def test_an_internal_error_is_a_500_with_an_openai_error_body(model_path, registry):
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))

    def broken_forward(*args, **kwargs):
        raise IndexError("a bug")
    engine.trunk.forward = broken_forward
    r = TestClient(create_app(engine), raise_server_exceptions=False).post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "IndexError" in r.json()["error"]["message"]


@contextlib.contextmanager
def _uvicorn(app):
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


def test_over_a_real_socket_a_client_that_times_out_stops_its_generation(slow_engine, reference):
    """uvicorn on a loopback port: a non-streaming client gives up after 0.3 s; its generation
    ends at the next token (far fewer than its 90 forwards run), and the next client's 5 tokens
    come right after (no forward of the abandoned request runs meanwhile)."""
    with _uvicorn(create_app(slow_engine)) as port:
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


def test_over_a_real_socket_headers_without_their_body_answer_408_and_close(engine):
    """A client sends the headers of a 100-byte body and nothing more: after body_timeout (1 s)
    it gets a 408 naming the wait and the connection closes; the server goes on serving."""
    with _uvicorn(create_app(engine, body_timeout=1.0)) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            sent, answer = time.monotonic(), b""
            while chunk := stalled.recv(65536):  # until the server closes; socket.timeout after 10 s
                answer += chunk
            took = time.monotonic() - sent
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and 0.9 < took < 5, (answer, took)
        error = json.loads(body)["error"]
        assert "did not arrive within 1 s (0 of its 100 bytes came)" in error["message"]
        assert error["code"] == "request_timeout"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("method, path, status", [("get", "/v1/nothing", 404), ("get", "/v1/chat/completions", 405),
                                                  ("delete", "/v1/models", 405)])
def test_unknown_paths_and_methods_answer_openais_error_body(client, method, path, status):
    response = getattr(client, method)(path)
    assert response.status_code == status
    error = response.json()["error"]
    assert path in error["message"] and "POST /v1/chat/completions" in error["message"]
    assert error["type"] == "invalid_request_error"


# -- a fresh user's check of `verispec serve`: tokenising, body size, shutdown, validation --------

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


def test_a_body_over_the_limit_is_a_413_naming_the_limit(engine):
    client = TestClient(create_app(engine, max_body_bytes=1000))
    for r in (client.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 2}),  # Content-Length
              client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),  # chunked
                          headers={"content-type": "application/json"})):
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert "at most 1000 bytes" in error["message"] and error["type"] == "invalid_request_error"
        assert error["code"] == "request_too_large"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "user": "u" * 850})  # ~900 bytes
    assert r.status_code == 200, r.text
    streamed = client.post("/v1/completions", content=iter([b'{"prompt": "the cat', b'", "max_tokens": 2}']),
                           headers={"content-type": "application/json"})
    assert streamed.status_code == 200 and streamed.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("messages,param,message", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role", "'wizard' is not a role; use one of system, "
                                                                "developer, user, assistant, tool"),
    ([MESSAGES[0], {"role": "user", "content": None}], "messages[1].content", "a user message needs content"),
    ([{"role": "system"}], "messages[0].content", "a system message needs content"),
    ([{"role": "developer", "content": None}], "messages[0].content", "only an assistant message may"),
    ([{"role": "user", "content": 5}], "messages[0].content",
     "messages[0].content: Input should be a valid string or Input should be a valid list"),
    ([{"content": "hi"}], "messages[0].role", "messages[0].role: Field required"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": {"a": 1}}]}],
     "messages[0].content[1].text",
     "messages[0].content[1].text: a text part's text is a string, not an object; send {"),
    ([{"role": "user", "content": [{"type": "text", "text": ["hi"]}]}], "messages[0].content[0].text",
     "not an array"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text",
     "not null (or missing)"),
])
def test_a_bad_message_is_a_400_naming_its_field(client, messages, param, message):
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_every_openai_role_and_a_null_assistant_content_are_accepted(client):
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "tool", "content": "42"},
                {"role": "user", "content": "and?"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_malformed_json_and_wrong_types_say_what_and_where(client):
    r = client.post("/v1/completions", content=b'{"prompt": }', headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON (at character 11: "), error
    assert "JSON decode error" not in error["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


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
