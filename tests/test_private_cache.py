"""Test sessions never write to the user's verispec cache: the workspace
conftest points VERISPEC_CACHE at a private directory for the whole session."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def test_the_session_cache_is_private():
    from verispec.checkpoints import cache_dir

    root = Path(os.environ["VERISPEC_CACHE"])
    assert cache_dir() == root.expanduser()
    if not os.environ.get("VERISPEC_TEST_CACHE"):
        assert root.name.startswith("verispec-test-cache-") and root.parent == Path(tempfile.gettempdir())
    assert root != Path.home() / ".cache" / "verispec"


def test_a_nested_session_removes_its_cache_and_leaves_the_users_alone(tmp_path):
    home = tmp_path / "home"
    (tmp_path / "test_inner.py").write_text(
        "import os\nfrom verispec.checkpoints import cache_dir\n"
        "def test_write():\n"
        "    (cache_dir('weights') / 'converted.pt').write_bytes(b'x' * 1000)\n"
        "    print('CACHE=' + os.environ['VERISPEC_CACHE'])\n")
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    (tmp_path / "conftest.py").write_text(conftest.read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("VERISPEC_CACHE", "VERISPEC_TEST_CACHE")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir",
                        str(tmp_path), str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    used = Path(next(line for line in r.stdout.splitlines() if "CACHE=" in line).split("CACHE=", 1)[1])
    assert not used.exists() and not (home / ".cache" / "verispec").exists()


def test_a_killed_sessions_cache_is_removed_by_the_next_session(tmp_path):
    """A session killed mid-run leaves verispec-test-cache-<pid>-*; the next one deletes it
    once that pid is gone, and leaves a live session's cache alone."""
    code = ("import os, sys, tempfile; sys.path.insert(0, sys.argv[1]); import conftest\n"
            "conftest.pytest_configure(None); print(os.environ['VERISPEC_CACHE'])")
    root = str(Path(__file__).resolve().parents[1])
    orphan = Path(subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                                 check=True).stdout.strip())
    assert orphan.is_dir() and orphan.name.startswith("verispec-test-cache-")  # never unconfigured: "killed"
    (orphan / "weights").mkdir()
    (orphan / "weights" / "converted.pt").write_bytes(b"x" * 1000)
    ours = Path(os.environ["VERISPEC_CACHE"])
    next_session = code + "\nconftest.pytest_unconfigure(None)"
    subprocess.run([sys.executable, "-c", next_session, root], capture_output=True, text=True, check=True)
    assert not orphan.exists() and ours.exists()
