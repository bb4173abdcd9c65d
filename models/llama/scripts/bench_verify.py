"""Cost of a one-row decode and of a k-row verify on a real llama/qwen2 GGUF, per weight dtype.

    python scripts/bench_verify.py --model smollm2-135m-instruct --dtypes int8,bfloat16,float32

For each dtype: prefill `--ctx` tokens into one sequence, then time a one-row decode
(`Segment(seq, [t])`, last-row logits, then `truncate(seq, ctx)`) and a k-row verify
(`Segment(seq, k rows, logits="all", verify=True)`, then `keep(seq, 0)`, as the loop does on
a full rejection) for each k, so every call starts from the same `--ctx` positions.
Reports min and median ms over `--reps` back-to-back calls, after waiting (up to 10 s) for
the machine to be quiet (other processes' CPU use below 0.2 cores), as shared machines are
noisy. Speed claims come from `verispec bench`; this is the per-row cost behind the default
draft-window ceiling (LlamaForCausalLM.spec_preferred_max_draft_tokens).
"""
import argparse
import statistics
import time

import torch
from verispec.seams import Segment


def _other_busy_cores(interval=0.2):
    """CPU cores other processes kept busy over `interval` seconds (from /proc/stat)."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all ticks, idle + iowait ticks
    total0, idle0 = read()
    own0 = time.process_time()
    time.sleep(interval)
    total1, idle1 = read()
    busy = ((total1 - total0) - (idle1 - idle0)) / 100 / interval  # USER_HZ = 100
    return max(busy - (time.process_time() - own0) / interval, 0.0)


def wait_quiet(limit_s=10.0):
    end = time.time() + limit_s
    while time.time() < end:
        if _other_busy_cores() < 0.2:
            return True
    return False


def timed(fn, reps):
    """(min ms, median ms, quiet) over `reps` back-to-back calls after one warm-up call.
    Calls run back to back, as in a decode loop: after an idle pause the first call is
    slower (clock and thread wake-up), so the quiet wait comes once, before the warm-up."""
    quiet = wait_quiet()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times), quiet


def bench(path, dtype: str, ks: list[int], ctx: int, reps: int) -> None:
    from verispec_llama.loader import load

    model = load(path, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, model.vocab_size - 100, (ctx,), generator=g)
    new = torch.randint(100, model.vocab_size - 100, (max(ks),), generator=g)
    seq = model.new_sequence()
    wait_quiet()
    t = time.perf_counter()
    model.forward([Segment(seq, context, logits="last")])
    prefill_s = time.perf_counter() - t

    def decode():
        model.forward([Segment(seq, new[:1], logits="last")])
        model.truncate(seq, ctx)

    base = timed(decode, reps)
    print(f"{dtype:9s} prefill {ctx} rows {prefill_s:.2f} s | decode 1 row: min {base[0]:.1f} ms, "
          f"median {base[1]:.1f} ms{'' if base[2] else ' (machine busy)'}", flush=True)
    for k in ks:
        def verify(k=k):
            model.forward([Segment(seq, new[:k], logits="all", verify=True)])
            model.keep(seq, 0)

        r = timed(verify, reps)
        print(f"{dtype:9s} verify k={k}: min {r[0]:.1f} ms ({r[0] / base[0]:.2f}x), median {r[1]:.1f} ms"
              f"{'' if r[2] else ' (machine busy)'}", flush=True)
    assert model.seq_len(seq) == ctx  # every timed call left the sequence as the prefill did
    model.release(seq)


def main():
    from verispec.api import resolve_model_path
    from verispec.registry import Registry

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="int8,bfloat16,float32")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--ctx", type=int, default=450)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model_path(a.model, Registry.discover())
    for dtype in a.dtypes.split(","):
        bench(path, dtype, [int(k) for k in a.ks.split(",")], a.ctx, a.reps)


if __name__ == "__main__":
    main()
