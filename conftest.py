"""Workspace-wide test set-up: every test session gets a private verispec cache.

Tests assemble checkpoints, build tokenizers and convert weights (the real Gemma 3 270M in
fp32, bf16 and int8 alone is ~1.9 GB); all of it goes to a temporary VERISPEC_CACHE that is
removed when the session ends, never to the user's ~/.cache/verispec. Set it in os.environ,
so `verispec` subprocesses started by tests use it too. A session killed before its end
leaves its directory; the next session removes it (the name carries the owner's pid).
VERISPEC_TEST_CACHE=DIR keeps one cache between runs instead (conversions then happen once:
reruns are ~30 s faster).

The test modules of the model, plugin and example packages and the workspace's tests/ run torch on one
thread (`_one_thread`); core's tests keep torch's default, since some of them test the threaded
kernels.
"""
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

_PREFIX = "verispec-test-cache-"
_ROOT = Path(__file__).resolve().parent
#: top-level folders whose test modules run torch on one thread
ONE_THREAD_TREES = ("models", "plugins", "examples", "tests")
_temporary: str | None = None


def pytest_configure(config):
    global _temporary
    # llama.cpp built by benchmarks/llama_cpp.py --build lives in the user's cache: keep it visible
    user_cache = os.environ.get("VERISPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "verispec")
    os.environ.setdefault("VERISPEC_LLAMA_CPP", os.path.join(user_cache, "llama.cpp"))
    kept = os.environ.get("VERISPEC_TEST_CACHE")
    if kept:
        os.environ["VERISPEC_CACHE"] = kept
        return
    _remove_orphans()
    _temporary = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
    os.environ["VERISPEC_CACHE"] = _temporary


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request):
    """Each test module under ONE_THREAD_TREES runs torch on one thread (verispec.testing.plugin's
    `one_thread`): tiny models, where OpenMP's spin-waits on a shared machine only cost time."""
    try:
        tree = Path(request.path).resolve().relative_to(_ROOT).parts[0]
    except ValueError:  # a module outside the workspace
        return
    if tree in ONE_THREAD_TREES:
        request.getfixturevalue("one_thread")


def pytest_unconfigure(config):
    if _temporary is not None:
        shutil.rmtree(_temporary, ignore_errors=True)


def _remove_orphans() -> None:
    """Caches of sessions whose process is gone (killed before pytest_unconfigure)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*-*"):
        match = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-.*", path.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
