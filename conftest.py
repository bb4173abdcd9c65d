"""Workspace-wide test set-up: every test session gets a private verispec cache.

Tests assemble checkpoints, build tokenizers and convert weights (the real Gemma 3 270M in
fp32, bf16 and int8 alone is ~1.9 GB); all of it goes to a temporary VERISPEC_CACHE that is
removed when the session ends, never to the user's ~/.cache/verispec. Set it in os.environ,
so `verispec` subprocesses started by tests use it too. A session killed before its end
leaves its directory; the next session removes it (the name carries the owner's pid).
VERISPEC_TEST_CACHE=DIR keeps one cache between runs instead (conversions then happen once:
reruns are ~30 s faster).

`./test.sh` runs the suite on pytest-xdist workers (one per core, four at most): every worker
uses the session's one cache (its entries are written whole or not at all: `cache_digest.save`),
and every test module runs torch on one thread (`_one_thread`), so two workers do not fight over
two cores; the tests of the threaded kernels set their own thread count.
"""
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

_PREFIX = "verispec-test-cache-"
_ROOT = Path(__file__).resolve().parent
_temporary: str | None = None


def pytest_configure(config):
    global _temporary
    # llama.cpp built by benchmarks/llama_cpp.py --build lives in the user's cache: keep it visible
    user_cache = os.environ.get("VERISPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "verispec")
    os.environ.setdefault("VERISPEC_LLAMA_CPP", os.path.join(user_cache, "llama.cpp"))
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's cache, inherited in os.environ
        return
    kept = os.environ.get("VERISPEC_TEST_CACHE")
    if kept:
        os.environ["VERISPEC_CACHE"] = kept
        return
    _remove_orphans()
    _temporary = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
    os.environ["VERISPEC_CACHE"] = _temporary


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request):
    """Each of the workspace's test modules runs torch on one thread (verispec.testing.plugin's
    `one_thread`): tiny models, where OpenMP's spin-waits beside another worker only cost time."""
    try:
        Path(request.path).resolve().relative_to(_ROOT)
    except ValueError:  # a module outside the workspace
        return
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
