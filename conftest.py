"""Workspace-wide test set-up: every test session gets a private verispec cache.

Tests assemble checkpoints, build tokenizers and convert weights (the real Gemma 3 270M in
fp32, bf16 and int8 alone is ~1.9 GB); all of it goes to a temporary VERISPEC_CACHE that is
removed when the session ends, never to the user's ~/.cache/verispec. Set it in os.environ,
so `verispec` subprocesses started by tests use it too. VERISPEC_TEST_CACHE=DIR keeps one
cache between runs instead (conversions then happen once: reruns are ~30 s faster).
"""
import os
import shutil
import tempfile

_temporary: str | None = None


def pytest_configure(config):
    global _temporary
    kept = os.environ.get("VERISPEC_TEST_CACHE")
    if kept:
        os.environ["VERISPEC_CACHE"] = kept
    else:
        _temporary = tempfile.mkdtemp(prefix="verispec-test-cache-")
        os.environ["VERISPEC_CACHE"] = _temporary


def pytest_unconfigure(config):
    if _temporary is not None:
        shutil.rmtree(_temporary, ignore_errors=True)
