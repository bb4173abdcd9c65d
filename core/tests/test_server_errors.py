"""The server's refusals (verispec.server over the toy plugin's GGUF): every rejected request is
an OpenAI error body naming its field and the fix (context and max_tokens limits, sampling
values, lone surrogates, bad messages, malformed JSON, a body over the limit or that never
arrives, unknown paths), a chat template that fails or is absent, and an internal error's 500."""
import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from server_kit import CONTEXT, MESSAGES, PROMPT, uvicorn_thread

from verispec import api
from verispec.engine import SpecOptions
from verispec.server import create_app
from verispec.testing.toy import write_toy_gguf


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


def test_an_internal_error_is_a_500_with_an_openai_error_body(model_path, registry):
    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))

    def broken_forward(*args, **kwargs):
        raise IndexError("a bug")
    engine.trunk.forward = broken_forward
    r = TestClient(create_app(engine), raise_server_exceptions=False).post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "IndexError" in r.json()["error"]["message"]


def test_over_a_real_socket_headers_without_their_body_answer_408_and_close(engine):
    """A client sends the headers of a 100-byte body and nothing more: after body_timeout (1 s)
    it gets a 408 naming the wait and the connection closes; the server goes on serving."""
    with uvicorn_thread(create_app(engine, body_timeout=1.0)) as port:
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


def test_malformed_json_and_wrong_types_say_what_and_where(client):
    r = client.post("/v1/completions", content=b'{"prompt": }', headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON (at character 11: "), error
    assert "JSON decode error" not in error["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
