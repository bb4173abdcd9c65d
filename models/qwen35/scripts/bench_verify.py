"""Verify cost on a tiny qwen35 fixture: a k-row verify vs one row, and what a partial keep adds.

    python models/qwen35/scripts/bench_verify.py --dtypes int8,float32 --ks 1,2,3,4,5,8,9

Builds the `bench` fixture of tests/tiny_qwen35.py (hidden 320, 12 layers = 9 GDN + 3 attention,
vocab 2048, an MTP block; transformers needed to write it), prefills `--ctx` tokens, then per
dtype times, from the same `--ctx` positions each call:
- decode: a one-row forward (`Segment(seq, [t])`, then `keep(seq, 0)` of a one-row verify);
- verify k: a k-row verify (`verify=True`, logits of every row) then `keep(seq, 0)`;
- verify k + keep(a): the same verify, then keep a = k // 2 rows (a partial acceptance);
- keep(a) alone: selecting the recorded per-row state (all a partial acceptance adds);
- a re-forward of a rows: what a snapshot + re-forward rollback would add instead;
- the MTP head: a first draft step with one catch-up row folded in, and a chained step.
The sequence grows by the kept rows as the reps go (a few hundred positions at most), which
changes the attention share of a call by well under the noise.
Reports min and median ms over `--reps` back-to-back calls after waiting for a quiet machine.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from verispec.seams import Segment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _other_busy_cores(interval=0.2):
    """CPU cores other processes kept busy over `interval` seconds (from /proc/stat)."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]
    total0, idle0 = read()
    own0 = time.process_time()
    time.sleep(interval)
    total1, idle1 = read()
    busy = ((total1 - total0) - (idle1 - idle0)) / 100 / interval
    return max(busy - (time.process_time() - own0) / interval, 0.0)


def wait_quiet(limit_s=10.0):
    end = time.time() + limit_s
    while time.time() < end:
        if _other_busy_cores() < 0.2:
            return True
    return False


def timed(fn, reps, setup=None):
    """(min ms, median ms) of fn over `reps` calls; `setup` (untimed) runs before each."""
    wait_quiet()
    if setup:
        setup()
    fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times)


def bench(path, dtype, ks, ctx, reps):
    from verispec_qwen35.loader import load

    model = load(path, dtype=dtype, use_cache=False)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.vocab_size, (ctx,), generator=g)
    new = torch.randint(0, model.vocab_size, (max(*ks, 3),), generator=g)
    seq = model.new_sequence()
    model.forward([Segment(seq, context, logits="last")])

    def decode():
        model.forward([Segment(seq, new[:1], logits="last", verify=True)])
        model.keep(seq, 0)

    base = timed(decode, reps)
    print(f"{dtype:8s} decode 1 row: min {base[0]:.2f} ms, median {base[1]:.2f} ms", flush=True)
    rows = []
    for k in ks:
        a = k // 2

        def verify(k=k):
            model.forward([Segment(seq, new[:k], logits="all", verify=True)])

        def undo():
            model.keep(seq, 0)

        def verify_keep_partial(k=k, a=a):
            model.forward([Segment(seq, new[:k], logits="all", verify=True)])
            model.keep(seq, a)

        full = timed(lambda: (verify(), undo()), reps)
        partial = timed(verify_keep_partial, reps)
        keep_only = timed(lambda a=a: model.keep(seq, a), reps, setup=verify)
        reforward = timed(lambda a=a: model.forward([Segment(seq, new[:max(a, 1)], logits="none")]), reps)
        rows.append((k, a, full, partial, keep_only, reforward))
        print(f"{dtype:8s} verify k={k}: {full[0]:.2f} ms ({full[0] / base[0]:.2f}x one row) | "
              f"verify + keep({a}): {partial[0]:.2f} ms | keep({a}) alone: {keep_only[0] * 1e3:.0f} us | "
              f"a re-forward of {max(a, 1)} rows would add {reforward[0]:.2f} ms", flush=True)
    _bench_head(model, seq, new, reps, base)
    return base, rows


def _bench_head(model, seq, new, reps, base):
    """The MTP head: a first draft step folding in 2 catch-up rows, and a chained step."""
    head = model.draft_head
    if head is None:
        return
    state = head.new_state()
    n = model.seq_len(seq)
    hidden = model.forward([Segment(seq, new[:3], logits="none", hidden=True, verify=True)])[0].hidden
    model.keep(seq, 0)
    head.draft_catch_up(state, new[:2].tolist(), hidden[:2], n)  # positions n, n+1 (n: no pair, a gap)

    def first():
        # one catch-up row queued, as after a verify that kept two rows
        state.num_valid, state.pending = n + 1, [(n + 1, int(new[1]), hidden[0])]
        return head.draft_step(state, int(new[2]), hidden[1], n + 2)

    _, h_out = first()
    step = timed(first, reps)
    chained = timed(lambda: head.draft_step(state, int(new[0]), h_out, n + 3), reps)
    print(f"{model.dtype:8s} MTP first step (+1 catch-up row): {step[0]:.2f} ms "
          f"({step[0] / base[0]:.2f}x one trunk row) | chained step: {chained[0]:.2f} ms "
          f"({chained[0] / base[0]:.2f}x)", flush=True)


def main():
    from tiny_qwen35 import TINY_CONFIGS, build_hf_model, write_fixture

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="int8,float32")
    ap.add_argument("--ks", default="1,2,3,4,5,8,9")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/qwen35-bench.gguf")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hf_model, mtp = build_hf_model("bench")
    path = write_fixture(hf_model, a.out, mtp=mtp, options=TINY_CONFIGS["bench"][3])
    for dtype in a.dtypes.split(","):
        bench(path, dtype, [int(k) for k in a.ks.split(",")], a.ctx, a.reps)


if __name__ == "__main__":
    main()
