"""benchmarks/llama_cpp.py: the llama.cpp build's progress bar follows make's and ninja's
progress lines on a terminal and is silent elsewhere (the build's output passes through)."""
import os
import sys
from pathlib import Path

import pytest

from verispec.testing.terminal import stderr_on_a_terminal

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
llama_cpp = pytest.importorskip("llama_cpp", reason="benchmarks/llama_cpp.py not found")  # our script

#: a stand-in for `cmake --build`: make's progress lines between other output
FAKE_BUILD = [sys.executable, "-c", "import time\nfor p in (10, 55, 100):\n"
                                    "    print(f'[{p:3d}%] Building CXX object ggml/x{p}.o', flush=True)\n"
                                    "    time.sleep(0.15)\nprint('done')"]


@pytest.mark.parametrize("line,percent", [("[ 42%] Building C object ggml/src/ggml.c.o", 42.0),
                                          ("[100%] Built target llama-bench", 100.0),
                                          ("[3/12] Building CXX object src/llama.cpp.o", 25.0),
                                          ("-- Configuring done", None), ("[0/0] nothing", None),
                                          ("warning: [ 42%] not at the start", None)])
def test_build_percent_reads_make_and_ninja_lines(line, percent):
    assert llama_cpp.build_percent(line) == percent


def test_off_a_terminal_the_output_passes_through_and_no_bar_is_drawn(tmp_path, capfd):
    llama_cpp.run_with_progress(FAKE_BUILD, "building llama.cpp", tmp_path / "build.log")
    out, err = capfd.readouterr()
    assert "[ 55%] Building CXX object" in out and out.rstrip().endswith("done")
    assert err == "" and not (tmp_path / "build.log").exists()


def _on_a_terminal(code: str) -> tuple[int, str]:
    """(exit status, what it wrote to stderr) of `python -c code` with stderr on a pseudo-terminal."""
    return stderr_on_a_terminal([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(BENCHMARKS)},
                                timeout=60)


def test_on_a_terminal_a_bar_follows_the_build_and_the_output_goes_to_the_log(tmp_path):
    log = tmp_path / "build.log"
    rc, err = _on_a_terminal(f"import llama_cpp; llama_cpp.run_with_progress({FAKE_BUILD!r}, 'building llama.cpp', "
                             f"__import__('pathlib').Path({str(log)!r}))")
    assert rc == 0, err
    assert "building llama.cpp:  55%" in err and "building llama.cpp: 100%" in err
    assert "Building CXX object" not in err
    assert log.read_text().splitlines()[-1] == "done"


def test_on_a_terminal_a_failed_step_prints_the_logs_tail_and_raises(tmp_path):
    failing = [sys.executable, "-c", "print('[ 20%] Building x'); print('error: no compiler'); raise SystemExit(2)"]
    rc, err = _on_a_terminal(f"import llama_cpp; llama_cpp.run_with_progress({failing!r}, 'building llama.cpp', "
                             f"__import__('pathlib').Path({str(tmp_path / 'build.log')!r}))")
    assert rc == 1 and "error: no compiler" in err and "CalledProcessError" in err
