"""verispec.cpu: the CLI's default thread count is the cores idle at start-up."""
import os
import subprocess
import sys

import pytest

from verispec.cpu import default_threads, idle_cores_between


def test_idle_cores_between_two_samples():
    assert idle_cores_between((100, 1000), (150, 1100), 2) == 1.0  # half the time idle on 2 cores
    assert idle_cores_between((100, 1000), (200, 1100), 2) == 2.0
    assert idle_cores_between((100, 1000), (100, 1100), 4) == 0.0
    assert idle_cores_between((100, 1000), (100, 1000), 2) == 2.0  # no time passed: assume idle
    assert idle_cores_between((100, 1000), (300, 1100), 2) == 2.0  # clamped


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_busy_core_is_not_counted():
    num_cores = os.cpu_count()
    assert 1 <= default_threads() <= num_cores
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num_cores - 1)]
    try:
        assert default_threads(interval_s=0.3) == 1  # every core but one is busy
    finally:
        for burner in burners:
            burner.kill()
