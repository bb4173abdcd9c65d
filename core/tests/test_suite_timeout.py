"""A hung test fails the run instead of hanging it: pytest-timeout is in core's
test extra and the root pytest config gives every test a generous bound with the thread method,
which also ends a hang inside C code (a collective, a lock) that a signal cannot interrupt."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _toml(path: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(path.read_text())


def test_the_root_config_bounds_every_test_and_core_installs_the_plugin():
    options = _toml(ROOT / "pyproject.toml")["tool"]["pytest"]["ini_options"]
    assert 600 <= options["timeout"] <= 3600 and options["timeout_method"] == "thread"
    extra = _toml(ROOT / "core" / "pyproject.toml")["project"]["optional-dependencies"]["test"]
    assert any(dep.startswith("pytest-timeout") for dep in extra)


def test_a_hanging_test_fails_the_run_under_the_root_config(tmp_path):
    pytest.importorskip("pytest_timeout")
    (tmp_path / "test_hang.py").write_text("import threading\n\n\ndef test_hang():\n    threading.Event().wait()\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(ROOT), "-o", "timeout=2", str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Timeout" in done.stdout + done.stderr, done.stdout[-2000:]
    assert time.monotonic() - began < 60
