"""The multi-machine launch of the README: the same `verispec generate --tp 2` command started
separately per rank with torchrun's variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), here
as two processes on loopback, each with its own environment (home, XDG and verispec cache
folders, its own copy of the GGUF), as two machines would have. Rank 0 prints the stream, which
must equal world size 1's (n-gram speculation on); rank 1 follows and exits 0 printing nothing.
"""
import json
import os
import shutil
import subprocess
import sys
from verispec.testing.serving import free_port

CLI = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
#: the launch variables a test process may have inherited; each rank gets its own.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _machine(root, name: str, fixture: str) -> tuple[dict, str]:
    """(environment, model path) of one simulated machine under root/name."""
    home = root / name
    for sub in ("home", "cache", "config", "data", "verispec-cache"):
        (home / sub).mkdir(parents=True)
    model = shutil.copy(fixture, home / "model.gguf")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("VERISPEC_")}
    env.update(HOME=str(home / "home"), XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"),
               XDG_DATA_HOME=str(home / "data"), VERISPEC_CACHE=str(home / "verispec-cache"), OMP_NUM_THREADS="1")
    return env, str(model)


def _generate(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-c", CLI, "generate", "The quick brown fox jumps", "--model", model,
            "--json", "--dtype", "fp32", "--threads", "1", "--max-tokens", "24", "--temperature", "0",
            "--ignore-eos", "--spec-type", "ngram", "--spec-adaptive", "off", *extra]




def test_two_separately_started_ranks_stream_what_one_process_does(tiny_fixture, tmp_path):
    _, path = tiny_fixture("qwen2")
    env, model = _machine(tmp_path, "alone", path)
    alone = subprocess.run(_generate(model), env=env, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0, alone.stderr
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env, model = _machine(tmp_path, f"rank{rank}", path)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank))
        ranks.append(subprocess.Popen(_generate(model, "--tp", "2"), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=60) for p in ranks)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert ranks[0].returncode == 0, err0
    assert ranks[1].returncode == 0 and out1 == "", err1
    expected, got = json.loads(alone.stdout), json.loads(out0)
    assert got["tokens"] == expected["tokens"] and len(got["tokens"]) == 24
    assert got["text"] == expected["text"]
    assert got["accepted"] > 0, "no draft was accepted: speculation untested"


def test_the_default_threads_are_shared_only_among_this_machines_ranks(monkeypatch):
    from verispec.tensor_parallel import local_ranks

    for name in LAUNCH_VARIABLES + ("LOCAL_WORLD_SIZE",):
        monkeypatch.delenv(name, raising=False)
    assert local_ranks(4) == 4  # spawned here: all four share this machine
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert local_ranks(4) == 1  # one rank a machine, as the README's launch runs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's count of ranks on this machine
    assert local_ranks(4) == 2
