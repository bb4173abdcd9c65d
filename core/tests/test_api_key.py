"""`verispec serve --api-key`: the official `openai` client against uvicorn on a loopback port
(over the toy GGUF) works with the key and raises AuthenticationError without it; /health and
the chat page stay open; the CLI reads VERISPEC_API_KEY."""

import httpx
import pytest

openai = pytest.importorskip("openai", reason="pip install openai (core's [test] extra)")
uvicorn = pytest.importorskip("uvicorn")

import verispec.cli.main as cli  # noqa: E402
from verispec import api  # noqa: E402
from verispec.cli.flags import build_parser  # noqa: E402
from verispec.engine import SpecOptions  # noqa: E402
from verispec.registry import Registry  # noqa: E402
from verispec.server import create_app  # noqa: E402
from verispec.testing import toy_plugin  # noqa: E402
from verispec.testing.serving import serving  # noqa: E402
from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf  # noqa: E402

KEY = "sk-test-3f9a"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    path = write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)
    engine = api.load(path, registry=Registry.from_plugins({"toy": toy_plugin}), context_length=128,
                      spec=SpecOptions(enabled=False))
    with serving(create_app(engine, model_name="toy", api_key=KEY)) as url:
        yield url


def test_the_official_client_with_the_key_gets_answers(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "the cat"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list()] == ["toy"]


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_an_authentication_error(base_url, key):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.completions.create(model="toy", prompt="the cat", max_tokens=4)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    assert "wrong API key" in raised.value.message


def test_no_key_is_a_401_in_openais_shape_and_health_stays_open(base_url):
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "the cat", "max_tokens": 4})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and "no API key" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/completions", headers={"Authorization": KEY},  # not "Bearer KEY"
                   json={"prompt": "the cat", "max_tokens": 4})
    assert r.status_code == 401
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


def test_the_cli_reads_the_key_from_the_environment_and_refuses_an_empty_one(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_API_KEY", KEY)
    assert build_parser().parse_args(["serve"]).api_key == KEY
    assert build_parser().parse_args(["serve", "--api-key", "other"]).api_key == "other"
    monkeypatch.setenv("VERISPEC_API_KEY", "")
    assert build_parser().parse_args(["serve"]).api_key is None
    assert cli.main(["serve", "--api-key", " "]) == 2  # a usage error, before any model loads
    assert "--api-key is empty" in capsys.readouterr().err
