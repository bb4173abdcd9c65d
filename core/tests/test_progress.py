"""verispec.progress.elapsed: drawn on a terminal once the work outlasts its delay, never for
short work, and silent when stderr is not a terminal. The sleeps leave wide margins (a 0.2 s
delay against 1.5 s of work; 1 s against 0.05 s)."""
import sys

from verispec.progress import elapsed
from verispec.testing.terminal import stderr_on_a_terminal


def _stderr_on_a_terminal(code: str) -> str:
    rc, err = stderr_on_a_terminal([sys.executable, "-c", code], timeout=60)
    assert rc == 0, err
    return err


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
