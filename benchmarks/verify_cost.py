"""What a k-row verify and a keep cost against k one-row decodes, on any registered trunk file.

    python benchmarks/verify_cost.py --model smollm2-135m-instruct --dtypes int8,float32
    python benchmarks/verify_cost.py --model /tmp/glm4moe-bench.gguf --ks 1,2,3,4,5,6,8,9,12,16,17

Per dtype, after prefilling `--ctx` tokens into one sequence, every timed call starts from the
same cached positions (k = rows in the verify: K drafts + 1):
- decode: a one-row forward (last-row logits), then `truncate` back (recurrent trunks, which
  cannot truncate, take a one-row verify and `keep(seq, 0)`);
- verify k: a k-row verify (`verify=True`, logits of every row) then `keep(seq, 0)`, as the loop
  does on a full rejection;
- keep(k // 2) alone: what a partial acceptance adds after the verify (attention KV: moving an
  integer; recurrent state: selecting the recorded row), timed with the verify run untimed before;
- a re-forward of k // 2 rows: what a snapshot + re-forward rollback would add instead.
Min ms over `--reps` back-to-back calls after waiting (up to 10 s) for other processes' CPU use
to drop below 0.2 cores; speed claims come from `verispec bench`, ratios from one run.

The draft-window ceiling (`spec_preferred_max_draft_tokens`) follows from the table: with a
per-depth acceptance a, a window of K drafts emits (1 − a^(K+1)) / (1 − a) tokens per verify of
K + 1 rows; the script prints, for a = 0.7 and 0.85, the K in the measured widths that emits the
most tokens per one-row decode time (verify + a keep of half the rows).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from verispec.seams import Segment


def other_busy_cores(interval: float = 0.2) -> float:
    """CPU cores other processes kept busy over `interval` seconds (from /proc/stat; USER_HZ 100)."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all ticks, idle + iowait ticks
    total0, idle0 = read()
    own0 = time.process_time()
    time.sleep(interval)
    total1, idle1 = read()
    busy = ((total1 - total0) - (idle1 - idle0)) / 100 / interval
    return max(busy - (time.process_time() - own0) / interval, 0.0)


def wait_quiet(limit_s: float = 10.0) -> bool:
    end = time.time() + limit_s
    while time.time() < end:
        if other_busy_cores() < 0.2:
            return True
    return False


def timed(fn, reps: int, setup=None) -> float:
    """Min ms of `fn` over `reps` back-to-back calls after one warm-up; `setup` (untimed) runs before each."""
    wait_quiet()
    times = []
    for _ in range(reps + 1):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times[1:])


def tokens_per_verify(acceptance: float, drafts: int) -> float:
    """Expected tokens one verify of `drafts` drafts emits at per-depth acceptance `acceptance`
    (accepted prefix + the correction or bonus token): (1 − a^(K+1)) / (1 − a)."""
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


def measure(model, ks: list[int], ctx: int, reps: int) -> tuple[float, dict[int, dict[str, float]]]:
    """(one-row decode ms, {k: {"verify", "keep", "reforward"} ms}) from `ctx` cached positions."""
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.vocab_size, (ctx,), generator=g)
    new = torch.randint(0, model.vocab_size, (max(ks),), generator=g)
    seq = model.new_sequence()
    model.forward([Segment(seq, context[:-1], logits="none")])
    model.forward([Segment(seq, context[-1:], logits="last")])
    recurrent = not _can_truncate(model, seq, ctx - 1)  # attention KV: back one position; recurrent: refused
    if not recurrent:
        model.forward([Segment(seq, context[-1:], logits="last")])

    def decode():
        if recurrent:
            model.forward([Segment(seq, new[:1], logits="last", verify=True)])
            model.keep(seq, 0)
        else:
            model.forward([Segment(seq, new[:1], logits="last")])
            model.truncate(seq, ctx)

    one_row = timed(decode, reps)
    table = {}
    for k in ks:
        half = k // 2

        def verify(k=k):
            model.forward([Segment(seq, new[:k], logits="all", verify=True)])

        def reject():
            model.keep(seq, 0)

        def reforward(half=half):
            model.forward([Segment(seq, new[:max(half, 1)], logits="none")])

        table[k] = {
            "verify": timed(lambda: (verify(), reject()), reps),
            "keep": timed(lambda half=half: model.keep(seq, half), reps,
                          setup=lambda: (_reset(model, seq, ctx, recurrent), verify())),
            "reforward": timed(reforward, reps, setup=lambda: _reset(model, seq, ctx, recurrent)),
        }
        _reset(model, seq, ctx, recurrent)
    assert recurrent or model.seq_len(seq) == ctx, "a timed call left rows behind"
    model.release(seq)
    return one_row, table


def _can_truncate(model, seq, length: int) -> bool:
    from verispec.nn.kv_cache import CannotTruncate

    try:
        model.truncate(seq, length)
        return True
    except CannotTruncate:  # recurrent state: whole sequences only
        return False


def _reset(model, seq, ctx: int, recurrent: bool) -> None:
    """Back to `ctx` positions where the trunk can truncate; a recurrent sequence keeps growing by
    the kept rows (a few hundred positions over a run: attention's share moves well under the noise)."""
    if not recurrent:
        model.truncate(seq, ctx)


def report(dtype: str, one_row: float, table: dict[int, dict[str, float]]) -> None:
    ks = sorted(table)
    print(f"\n{dtype}: one-row decode {one_row:.2f} ms")
    print("| k rows | verify + keep(0) | ÷ one row | keep(k//2) alone | re-forward of k//2 rows |")
    print("|---|---|---|---|---|")
    for k in ks:
        t = table[k]
        print(f"| {k} | {t['verify']:.2f} ms | {t['verify'] / one_row:.2f}x | {t['keep'] * 1e3:.0f} µs | "
              f"{t['reforward']:.2f} ms |")
    for a in (0.7, 0.85):
        rate = {k - 1: tokens_per_verify(a, k - 1) / ((table[k]["verify"] + table[k]["keep"]) / one_row)
                for k in ks if k >= 2}
        best = max(rate, key=rate.get)
        print(f"acceptance {a}: tokens per one-row time " + ", ".join(f"K={K}: {r:.2f}" for K, r in rate.items())
              + f" -> best K = {best}")


def main(argv=None) -> None:
    from verispec.model_files import load_registered_trunk, resolve_model_path
    from verispec.registry import Registry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="alias or GGUF path of any registered trunk")
    ap.add_argument("--dtypes", default="int8,float32")
    ap.add_argument("--ks", default="1,2,3,4,5,8,9")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    registry = Registry.discover()
    path = resolve_model_path(a.model, registry)
    ks = sorted({1, *(int(k) for k in a.ks.split(","))})
    for dtype in a.dtypes.split(","):
        model = load_registered_trunk(path, registry, dtype=dtype, threads=a.threads)
        one_row, table = measure(model, ks, a.ctx, a.reps)
        report(dtype, one_row, table)


if __name__ == "__main__":
    main()
