"""Tensor parallelism's process model: rank 0 drives, the other ranks replay its trunk calls.

Rank 0 owns everything above the trunk seam (scheduler, speculators, governor, server) and holds
a `BroadcastTrunk`: each call that changes the trunk or runs a collective (forward, keep,
truncate, fork, release, new_sequence, and the view's embed / logits) is first broadcast as one
pickled `(name, args)` with `torch.distributed.broadcast_object_list`, then run on rank 0's own
shard. Every other rank runs `follow`: receive, run the same call on its shard, repeat; the
forward's all-reduces and gathers (verispec.nn.parallel) then line up. Sequence ids agree
because every rank sees the same calls in the same order. This sits here, in one core module,
because it is the same for every family (only the shard math is a family's), and it uses
torch.distributed alone: no transport of ours.

Three process groups, whose timeouts gloo keeps per process: the math collectives run under
`timeout_s` (VERISPEC_TP_TIMEOUT seconds, default DEFAULT_TIMEOUT_S), and so do rank 0's sends
of the call broadcast (gloo's send waits for the receiver), so a rank that dies or hangs
mid-request makes rank 0's next call raise `RankLost` within it: never a hang. The followers
wait for the next call with a long timeout (idle between requests; a dead rank 0 closes its
sockets, and their wait fails then), and every rank waits long at the barrier after loading
(a long first conversion is not a lost rank). After a loss every call raises the same RankLost at once, except `release`, which frees
rank 0's own shard of the sequence (so the engine can fail its requests and release them); the
engine's requests fail with it (the server answers 503 and exits: verispec.server).

Launch: `start(world_size)` (what `--tp N` does) spawns ranks 1..N-1 on this machine as
`python -m verispec.tensor_parallel MODEL ...` with MASTER_ADDR / MASTER_PORT / RANK /
WORLD_SIZE set; when RANK and WORLD_SIZE are already in the environment (torchrun, or the same
command run on each machine with MASTER_ADDR set) nothing is spawned and this process is that rank.
Backend: gloo for CPU tensors; where CUDA is present the math group also routes CUDA tensors to
NCCL ("cpu:gloo,cuda:nccl"), so a trunk on CUDA reduces over NCCL. The call broadcast is gloo.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from verispec.errors import VerispecError
from verispec.nn.parallel import Shards

__all__ = ["DEFAULT_TIMEOUT_S", "BroadcastTrunk", "Group", "RankLost", "collective_timeout", "follow", "init_group",
           "load_parallel_trunk", "start"]

#: seconds a math collective may wait for another rank before RankLost (VERISPEC_TP_TIMEOUT overrides).
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "VERISPEC_TP_TIMEOUT"
#: seconds a lost local rank's exit status is waited for, to name it.
EXIT_GRACE_S = 1.0
#: seconds idle followers wait for rank 0's next call.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0

#: the calls that change the trunk or run collectives; the rest rank 0 answers from its shard.
TRUNK_CALLS = frozenset({"forward", "keep", "truncate", "fork", "release", "new_sequence"})


class RankLost(VerispecError, RuntimeError):
    """A tensor-parallel rank stopped answering (died, or slower than the collective timeout).
    The server answers it with HTTP 503 (the model cannot serve until restarted)."""

    http_status = 503


@attrs.frozen
class Group:
    """This process in a tensor-parallel group: `shards` (rank, world size, math group), the
    call-broadcast group (timeout_s on rank 0, IDLE_TIMEOUT_S on the others) and the `loaded`
    barrier's group (IDLE_TIMEOUT_S); `timeout_s` bounds each math collective."""

    shards: Shards
    calls: object = attrs.field(eq=False, repr=False)
    timeout_s: float
    followers: tuple = attrs.field(default=(), eq=False, repr=False)  # spawned local ranks (Popen)
    loaded: object = attrs.field(default=None, eq=False, repr=False)

    @property
    def rank(self) -> int:
        return self.shards.rank

    @property
    def world_size(self) -> int:
        return self.shards.world_size


def init_group(rank: int | None = None, world_size: int | None = None, address: str | None = None, *,
               timeout_s: float = DEFAULT_TIMEOUT_S, followers: Sequence = ()) -> Group:
    """Join a gloo group as `rank` of `world_size`, rank 0 listening at `address` ("host:port");
    each left None is read from the environment (RANK, WORLD_SIZE, MASTER_ADDR:MASTER_PORT),
    torchrun's names. Raises RankLost when the other ranks do not join within timeout_s."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    address = address or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    import torch

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        idle = datetime.timedelta(seconds=IDLE_TIMEOUT_S)
        calls = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s) if rank == 0 else idle)
        loaded = dist.new_group(backend="gloo", timeout=idle)
    except RuntimeError as e:  # DistStoreError / DistNetworkError subclass it
        raise RankLost(f"rank {rank} of {world} could not join the tensor-parallel group at {address} "
                       f"within {timeout_s:g} s: {_first_line(e)}") from e
    return Group(Shards(rank, world), calls, timeout_s, loaded=loaded, followers=tuple(followers))


def _first_line(error: BaseException) -> str:
    """torch.distributed's errors may carry a C++ backtrace after their first line."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(world_size: int) -> int:
    """How many of the `world_size` ranks run on this machine: all of them when `start` spawns
    them; under a torchrun-style launch (RANK / WORLD_SIZE set) torchrun's LOCAL_WORLD_SIZE, else 1
    (one rank a machine, as the README's multi-machine launch runs)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return world_size


def start(world_size: int, follower_args: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
    """This process as rank 0 of `world_size` local ranks: spawn ranks 1..N-1 running
    `python -m verispec.tensor_parallel *follower_args` (their stderr is ours), then join.

    When RANK / WORLD_SIZE are set (torchrun-style launch), spawns nothing and joins as that rank;
    raises VerispecError when WORLD_SIZE disagrees with world_size."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise VerispecError(f"--tp {world_size}, but the environment says WORLD_SIZE={os.environ['WORLD_SIZE']}; "
                                "give the same world size (or leave RANK/WORLD_SIZE unset to spawn local ranks)")
        return init_group(timeout_s=timeout_s)
    port = _free_port()
    followers = []
    for rank in range(1, world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank))
        followers.append(subprocess.Popen([sys.executable, "-m", "verispec.tensor_parallel", *follower_args], env=env))
    return init_group(0, world_size, f"127.0.0.1:{port}", timeout_s=timeout_s, followers=followers)


class BroadcastTrunk:
    """Rank 0's trunk: the `seams.Trunk` of its shard, each call in TRUNK_CALLS broadcast first.

    Reads (vocab_size, max_context_length, seq_len, tokenizer, spec_batch_invariant, ...) come
    from rank 0's shard, whose sizes are the whole model's. Once a rank is lost every call raises
    RankLost. `close()` tells the followers to exit (also at interpreter exit)."""

    def __init__(self, trunk, group: Group):
        self._trunk, self._group, self._lost, self._closed = trunk, group, None, False
        atexit.register(self.close)

    def __getattr__(self, name):
        return getattr(self._trunk, name)

    def _call(self, target: str, name: str, *args):
        import torch.distributed as dist

        if self._lost is not None:
            raise self._lost
        try:
            dist.broadcast_object_list([(target, name, args)], src=0, group=self._group.calls)
            return getattr(self._trunk if target == "trunk" else self._trunk.view(), name)(*args)
        except RuntimeError as e:
            if isinstance(e, VerispecError):
                raise
            self._lost = RankLost(f"{_who_stopped(self._group)} stopped answering during {name} (collective "
                                  f"timeout {self._group.timeout_s:g} s): {e}; the model cannot run without every "
                                  "rank: restart it (all ranks)")
            raise self._lost from e

    def forward(self, batch):
        return self._call("trunk", "forward", list(batch))

    def new_sequence(self):
        return self._call("trunk", "new_sequence")

    def keep(self, seq, num_rows):
        return self._call("trunk", "keep", seq, num_rows)

    def truncate(self, seq, length):
        return self._call("trunk", "truncate", seq, length)

    def fork(self, seq, length):
        return self._call("trunk", "fork", seq, length)

    def release(self, seq):
        if self._lost is not None:  # the followers are gone: free rank 0's shard of it alone
            return self._trunk.release(seq)
        return self._call("trunk", "release", seq)

    def view(self):
        return _BroadcastView(self)

    def close(self) -> None:
        """Send the followers the stop call and leave the group (idempotent)."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        if self._lost is None:
            try:
                dist.broadcast_object_list([None], src=0, group=self._group.calls)
            except RuntimeError:
                pass
        self._lost = self._lost or RankLost("the tensor-parallel group was closed")
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self._group.followers:
            try:
                p.wait(timeout=self._group.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def _who_stopped(group: Group) -> str:
    """"rank 1 (killed by signal 9) of 2 tensor-parallel ranks" or "rank 2 (stopped by a signal)
    of 3 ..." for the local ranks this process spawned that were killed (ended by a signal within
    EXIT_GRACE_S) or that the kernel reports stopped (SIGSTOP, SIGTSTP: state T in /proc/PID/stat;
    alive, sockets open, answering nothing); else "rank 1 (exit status 1) ..." for those that
    exited; "a tensor-parallel rank of N" when none did (a remote rank, or one that hangs while
    running). An exit is named only when nothing was killed or stopped: a live rank waiting in
    the same collective as a stopped one times out too and exits 1, and is not the cause."""
    halted, exited, deadline = [], [], time.monotonic() + EXIT_GRACE_S  # sockets close before the reap
    for rank, process in enumerate(group.followers, start=1):
        if _process_state(process.pid) in ("T", "t"):
            halted.append(f"rank {rank} (stopped by a signal)")
            continue
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            halted.append(f"rank {rank} (killed by signal {-code})")
        elif code is not None:
            exited.append(f"rank {rank} (exit status {code})")
    named = halted or exited
    if not named:
        return f"a tensor-parallel rank of {group.world_size}"
    return f"{', '.join(named)} of {group.world_size} tensor-parallel ranks"


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process `pid` (R, S, D, T stopped, t traced-stopped, Z, ...)
    from /proc/PID/stat, or None where there is no such file (another OS, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # after "(comm)", which may hold spaces or parentheses


class _BroadcastView:
    """The seams.TrunkView of a BroadcastTrunk: embed and logits are collectives, broadcast first."""

    def __init__(self, trunk: BroadcastTrunk):
        self._trunk = trunk
        self.vocab_size, self.hidden_size = trunk.vocab_size, trunk.hidden_size

    def tap_feature_size(self, tap_layers):
        return self._trunk._trunk.tap_feature_size(tap_layers)

    def embed(self, tokens):
        return self._trunk._call("view", "embed", tokens)

    def logits(self, hidden):
        return self._trunk._call("view", "logits", hidden)

    def kv(self, seq, layer):
        raise NotImplementedError("a tensor-parallel trunk holds each rank's KV heads apart; kv() is not wired yet")


def follow(trunk, group: Group) -> None:
    """Run rank 0's calls on this rank's shard until it sends stop. A call rank 0 refuses before
    any collective (an unknown sequence, an overflow) is refused here the same way and skipped.
    Raises RankLost when rank 0 or a peer is lost."""
    import torch.distributed as dist

    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=group.calls)
            if message[0] is None:
                break
            target, name, args = message[0]
            try:
                getattr(trunk if target == "trunk" else trunk.view(), name)(*args)
            except (VerispecError, ValueError):
                continue  # rank 0 raised it too, before any collective
        except RuntimeError as e:
            raise RankLost(f"rank {group.rank}: lost the tensor-parallel group: {_first_line(e)}") from e
    dist.destroy_process_group()


def load_parallel_trunk(loader, path: str, *, world_size: int, dtype: str | None = None,
                        context_length: int | None = None, threads: int | None = None,
                        timeout_s: float | None = None):
    """Rank 0's BroadcastTrunk over `world_size` ranks of `loader` (a family's TrunkSpec loader,
    called with shards=...). Spawns local ranks unless RANK/WORLD_SIZE are set; on a rank other
    than 0 this follows rank 0 until it closes, then exits the process (SystemExit 0).
    timeout_s: seconds each collective waits for a rank (None: VERISPEC_TP_TIMEOUT, else
    DEFAULT_TIMEOUT_S). Raises nn.parallel.HeadsNotDivisible (before anything is spawned),
    InvalidArgument (a VERISPEC_TP_TIMEOUT that is not a positive number), RankLost, the loader's errors."""
    from verispec.gguf.io import GGUFFile

    timeout_s = collective_timeout() if timeout_s is None else timeout_s
    _check_heads(GGUFFile.open(path), world_size)
    args = [path, "--world-size", str(world_size), "--timeout", str(timeout_s)]
    args += ["--dtype", dtype] if dtype else []
    args += ["--context-length", str(context_length)] if context_length else []
    args += ["--threads", str(threads)] if threads else []
    group = start(world_size, args, timeout_s=timeout_s)
    trunk = _load_shard(loader, path, group, dtype, context_length)
    if group.rank != 0:
        follow(trunk, group)
        raise SystemExit(0)
    return BroadcastTrunk(trunk, group)


def collective_timeout() -> float:
    """Seconds a collective waits for another rank: VERISPEC_TP_TIMEOUT when set, else
    DEFAULT_TIMEOUT_S. Raises InvalidArgument when it is not a positive number."""
    from verispec.errors import InvalidArgument

    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InvalidArgument(f"{TIMEOUT_ENV}={text!r}: give the seconds a tensor-parallel collective may wait "
                              f"for a rank as a positive number (default {DEFAULT_TIMEOUT_S:g})")
    return value


def _load_shard(loader, path, group: Group, dtype, context_length):
    import torch.distributed as dist

    trunk = loader(path, dtype=dtype, context_length=context_length, shards=group.shards)
    dist.barrier(group=group.loaded)  # every rank loaded (a long first conversion is not a lost rank)
    return trunk


def _check_heads(gguf, world_size: int) -> None:
    """HeadsNotDivisible before any process starts (the model classes check again)."""
    counts = {"attention heads": gguf.arch_key("attention.head_count", 0)}
    counts["KV heads"] = gguf.arch_key("attention.head_count_kv", counts["attention heads"])
    heads = {k: int(v if not hasattr(v, "__len__") else max(v)) for k, v in counts.items()}
    if all(heads.values()) and any(n % world_size for n in heads.values()):
        from verispec.nn.parallel import HeadsNotDivisible

        raise HeadsNotDivisible(world_size, heads)


def main(argv: list[str] | None = None) -> int:
    """A spawned rank: `python -m verispec.tensor_parallel MODEL --world-size N [--dtype ...]`.
    Exit status 0 when rank 0 closed the group; 1, with one line on stderr, on a lost group
    (RankLost) or another of verispec's errors (rank 0 reports the loss with its own line)."""
    try:
        return _follow_main(argv)
    except VerispecError as e:
        print(f"verispec: error: {e}", file=sys.stderr, flush=True)
        return 1


def _follow_main(argv: list[str] | None) -> int:
    import argparse

    import torch

    from verispec.gguf.io import read_architecture
    from verispec.registry import Registry
    from verispec.specs import resolve

    p = argparse.ArgumentParser(prog="python -m verispec.tensor_parallel")
    p.add_argument("model")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--dtype")
    p.add_argument("--context-length", type=int)
    p.add_argument("--threads", type=int)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    loader = resolve(Registry.discover().trunk_for_architecture(read_architecture(a.model)).loader)
    group = init_group(timeout_s=a.timeout)
    follow(_load_shard(loader, a.model, group, a.dtype, a.context_length), group)
    return 0


if __name__ == "__main__":
    status = main()
    if status:  # a lost group's transport threads may still run: interpreter teardown with them alive
        sys.stderr.flush()  # aborts ("terminate called without an active exception", SIGABRT), which
        os._exit(status)  # would turn the one-line exit 1 into a crash
    sys.exit(status)
