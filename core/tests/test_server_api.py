"""The OpenAI-compatible server (verispec.server) over the toy plugin's GGUF, through
fastapi.testclient (no socket): completions, chat, sampling and logprobs answer what the engine
called directly gives, with usage and finish reasons; /v1/models and /health."""
import pytest
from server_kit import MESSAGES, PROMPT, sse_payloads

from verispec.sampling import SamplingParams


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


def test_models_and_health(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["toy"]
    assert client.get("/health").json() == {"status": "ok", "speculator": None}


def test_every_openai_role_and_a_null_assistant_content_are_accepted(client):
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "tool", "content": "42"},
                {"role": "user", "content": "and?"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
