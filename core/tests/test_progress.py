"""verispec.progress.elapsed: drawn on a terminal once the work outlasts its delay, never for
short work, and silent when stderr is not a terminal. The sleeps leave wide margins (a 0.2 s
delay against 1.5 s of work; 1 s against 0.05 s)."""
import os
import subprocess
import sys

from verispec.progress import elapsed


def _stderr_on_a_terminal(code: str) -> str:
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen([sys.executable, "-c", code], stderr=follower, stdout=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


def test_long_work_shows_its_name_and_elapsed_time_on_a_terminal():
    err = _stderr_on_a_terminal("import time; from verispec.progress import elapsed\n"
                                "with elapsed('loading model.gguf', delay=0.2, interval=0.1): time.sleep(1.5)")
    assert "loading model.gguf [00:0" in err


def test_short_work_draws_nothing_on_a_terminal():
    err = _stderr_on_a_terminal("import time; from verispec.progress import elapsed\n"
                                "with elapsed('loading model.gguf', delay=1.0): time.sleep(0.05)")
    assert "loading" not in err


def test_silent_when_stderr_is_not_a_terminal(capfd):
    import time

    with elapsed("loading model.gguf", delay=0.0, interval=0.05):
        time.sleep(0.3)
    assert capfd.readouterr().err == ""
