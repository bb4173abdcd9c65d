"""How many cores are idle right now: the CLI's default thread count when --threads is not given.

On a 2-core machine that something else keeps busy, two OpenMP threads spin-wait on each
other and a decode slows 3-20x; one thread is then 2x faster than two (measured on the
Gemma 3 270M, int8, 64-token plain decode: quiet 45-53 tok/s with 2 threads, 35-40 with 1;
beside one CPU-burning process 13-16 with 2, 30-35 with 1; OMP_WAIT_POLICY=PASSIVE gave
29-33 loaded but 25-30 quiet, so it is not the default). Sampling /proc/stat for 0.2 s at
start-up tells which of the two situations holds; elsewhere (no /proc) torch's default stands.
"""
from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies over all cores from /proc/stat's first line, or None without it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])  # user..steal; guest time is already counted in user


def idle_cores_between(before: tuple[int, int], after: tuple[int, int], num_cores: int) -> float:
    """Cores' worth of idle time between two /proc/stat samples, in [0, num_cores]."""
    total = after[1] - before[1]
    if total <= 0:
        return float(num_cores)
    return num_cores * min(max((after[0] - before[0]) / total, 0.0), 1.0)


def default_threads(interval_s: float = 0.1, samples: int = 2) -> int | None:
    """Threads for a decode that starts now: the idle cores (at least 1), or None where /proc
    is unavailable. The most idle of `samples` windows of `interval_s` counts, so a process
    that is just exiting (a previous command's teardown) does not look like lasting load."""
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    times = [_cpu_times()]
    for _ in range(samples):
        time.sleep(interval_s)
        times.append(_cpu_times())
    if None in times:
        return None
    idle = max(idle_cores_between(a, b, os.cpu_count() or num_cores) for a, b in zip(times, times[1:]))
    return max(1, min(num_cores, round(idle)))


#: the slowest sustained weight-streaming rate a decode here should see (bytes/s): a quiet
#: 2-core EPYC streams ~22 GB/s, so a step slower than its weights at 10 GB/s, times
#: SLOW_FACTOR, is waiting on something else (measured: Gemma 3 270M int8, 2 threads beside a
#: compile, 600 ms/token against 21 ms quiet).
FLOOR_BYTES_PER_S = 10e9
SLOW_FACTOR = 3.0
#: the fixed cost of one decode step besides reading the weights (Python, scheduling, the
#: sampler: ~1 ms on a quiet machine), so a model of a few MB is not "slow" at 1 ms/token
STEP_ALLOWANCE_MS = 2.0


def weight_bytes(module) -> int:
    """Bytes of every parameter and buffer a forward reads (a tied table counted once)."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen and not tensor.is_meta:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def slow_decode_hint(ms_per_token: float, num_bytes: int, threads: int | None) -> str | None:
    """One line when a decode ran far slower than a step should take, else None.

    A step should take its weights streamed at FLOOR_BYTES_PER_S plus STEP_ALLOWANCE_MS (2 ms)
    of fixed per-step overhead; the line comes when the decode is over SLOW_FACTOR (3x) that.
    ms_per_token: measured decode time per emitted token (ms); num_bytes: `weight_bytes`.
    """
    expected_ms = 1e3 * num_bytes / FLOOR_BYTES_PER_S + STEP_ALLOWANCE_MS
    if ms_per_token <= SLOW_FACTOR * expected_ms:
        return None
    fix = "pass --threads 1" if (threads or 0) > 1 else "stop the other work on the cores"
    return (f"hint: decode took {ms_per_token:.0f} ms/token, over {SLOW_FACTOR:.0f}x the {expected_ms:.0f} ms that "
            f"reading its {num_bytes / 1e6:.0f} MB of weights and a step's {STEP_ALLOWANCE_MS:.0f} ms of overhead "
            f"should take; another process is probably using the "
            f"cores: {fix}")


def generation_hint(engine, result) -> str | None:
    """`slow_decode_hint` for a finished generation (`engine.generate(...).result`) (without it a loaded machine is silent), judged
    without the speculator's drafting: when drafting alone made the decode slow, it names the
    speculator instead of blaming the machine."""
    import torch

    if result.decode_tokens_per_s <= 0 or len(result.tokens) < 8 or not isinstance(engine.trunk, torch.nn.Module):
        return None
    ms_per_token = 1e3 / result.decode_tokens_per_s
    draft_ms_per_token = 1e3 * result.spec.draft_s / (len(result.tokens) - 1)  # decode_tokens_per_s's tokens
    num_bytes, threads = weight_bytes(engine.trunk), torch.get_num_threads()
    hint = slow_decode_hint(ms_per_token - draft_ms_per_token, num_bytes, threads)
    if hint is None and draft_ms_per_token > 0 and slow_decode_hint(ms_per_token, num_bytes, threads):
        return (f"hint: decode took {ms_per_token:.0f} ms/token, {draft_ms_per_token:.0f} ms of it drafting "
                f"in speculator {result.speculator!r} (its propose): the plugin is slow, not the machine; "
                "pass --no-spec or another --spec-type")
    if hint and gguf_without_kernels(engine.trunk):  # the cause is ours, not another process
        return (f"hint: decode took {1e3 / result.decode_tokens_per_s:.0f} ms/token: the gguf weights run on the "
                "PyTorch path, ~20x slower, because the C kernels are off (VERISPEC_C_KERNELS=0) or could not be "
                "built (the warning above says why): install a C compiler, or pass --dtype int8")
    return hint


def gguf_without_kernels(trunk) -> bool:
    """The trunk has gguf block linears and the C kernels are unavailable (their slow PyTorch path runs)."""
    from verispec.kernels import ckernels
    from verispec.weights.block_linear import BlockLinear

    return ckernels.library() is None and any(isinstance(m, BlockLinear) for m in trunk.modules())
