"""Verify cost on a tiny qwen35 fixture, and what its MTP head's draft steps cost.

    python models/qwen35/scripts/bench_verify.py --dtypes int8,float32 --ks 1,2,3,4,5,8,9

Builds the `bench` fixture of tests/tiny_qwen35.py (hidden 320, 12 layers = 9 GDN + 3 attention,
vocab 2048, an MTP block; transformers needed to write it), then per dtype prints
benchmarks/verify_cost.py's table (a one-row decode, a k-row verify + keep(0), keep(k // 2)
alone: selecting the recorded per-row state, and the re-forward a snapshot + re-forward rollback
would add instead), and the MTP head: a first draft step with one catch-up row folded in, and a
chained step. Min ms over `--reps` back-to-back calls after waiting for a quiet machine.
"""
import argparse
import sys
from pathlib import Path

import torch
from verispec.seams import Segment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import verify_cost  # noqa: E402 (benchmarks/verify_cost.py)


def bench(path, dtype, ks, ctx, reps):
    from verispec_qwen35.loader import load

    model = load(path, dtype=dtype, use_cache=False)
    one_row, table = verify_cost.measure(model, ks, ctx, reps)
    verify_cost.report(dtype, one_row, table)
    g = torch.Generator().manual_seed(0)
    seq = model.new_sequence()
    model.forward([Segment(seq, torch.randint(0, model.vocab_size, (ctx,), generator=g), logits="last")])
    _bench_head(model, seq, torch.randint(0, model.vocab_size, (3,), generator=g), reps, one_row)
    return one_row, table


def _bench_head(model, seq, new, reps, one_row):
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
    step = verify_cost.timed(first, reps)
    chained = verify_cost.timed(lambda: head.draft_step(state, int(new[0]), h_out, n + 3), reps)
    print(f"{model.dtype:8s} MTP first step (+1 catch-up row): {step:.2f} ms "
          f"({step / one_row:.2f}x one trunk row) | chained step: {chained:.2f} ms "
          f"({chained / one_row:.2f}x)", flush=True)


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
