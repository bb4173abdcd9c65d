"""A tensor-parallel follower that loses its group says so in one line: rank 0
(a subprocess here) joins, loads its shard, and is killed, as a crashed rank 0 would be; the
follower (`python -m verispec.tensor_parallel`, rank 1) exits 1 with one `verispec: error: rank 1:
lost the tensor-parallel group: ...` line and no traceback."""
import os
import subprocess
import sys

from verispec.testing.serving import free_port

RANK_0 = r"""
import sys, time, torch
torch.set_num_threads(1)
from verispec.gguf.io import read_architecture
from verispec.registry import Registry
from verispec.specs import resolve
from verispec.tensor_parallel import _load_shard, init_group

path, port = sys.argv[1], sys.argv[2]
group = init_group(0, 2, f"127.0.0.1:{port}", timeout_s=60)
_load_shard(resolve(Registry.discover().trunk_for_architecture(read_architecture(path)).loader), path, group,
            "fp32", None)
print("loaded", flush=True)
time.sleep(600)
"""


def test_a_follower_that_loses_rank_0_exits_1_with_one_line(tiny_fixture):
    _, path = tiny_fixture("qwen2")
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0, path, str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    follower = subprocess.Popen([sys.executable, "-m", "verispec.tensor_parallel", path, "--world-size", "2",
                                 "--timeout", "60", "--dtype", "fp32", "--threads", "1"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rank_0.stdout.readline().strip() == "loaded", rank_0.communicate(timeout=5)
        rank_0.kill()  # SIGKILL: its sockets close, the follower's wait for the next call fails
        rank_0.wait()
        _, err = follower.communicate(timeout=120)
    finally:
        for process in (rank_0, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert follower.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("verispec: error: ")]
    assert len(ours) == 1 and ours[0].startswith("verispec: error: rank 1: lost the tensor-parallel group: "), err
