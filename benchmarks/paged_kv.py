"""What paged KV would cost a one-row decode here: gathering a sequence's K/V blocks from a
shared pool into the contiguous [Hkv, T, Dh] the attention bmm reads, against reading the
contiguous per-sequence cache verispec keeps (a view, no copy).

    python benchmarks/paged_kv.py [--model smollm2-135m-instruct ...] [--context 128 512 2048]

PyTorch has no paged-attention CPU kernel: without one, a block table means one gather of K
and one of V per attention layer per decode step (`index_select` over blocks of --block
positions, then a copy into the bmm's layout). Per model (its attention layers' Hkv and Dh,
read from the loaded trunk) and context length, it prints the gather's ms per token beside a
measured plain decode step at that context, both timed in this process: the ratio is what
block tables would add to every decode. Wall clock, 2 threads: compare rows of one run only.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from verispec.api import load_target, resolve_model_path
from verispec.nn.state import LinearKVCache
from verispec.registry import Registry
from verispec.seams import Segment


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def linear_layer_shapes(target) -> list[tuple[int, int]]:
    """(Hkv, Dh) of every layer with a LinearKVCache (the layers block tables would page)."""
    seq = target.new_sequence()
    shapes = [(s.num_kv_heads, s.head_dim) for s in target._state(seq).layers if isinstance(s, LinearKVCache)]
    target.release(seq)
    return shapes


def gather_s(shapes, context: int, block: int) -> float:
    """Seconds to gather K and V of every paged layer for one decode at `context` positions."""
    num_blocks = -(-context // block)
    pools = [torch.randn(4 * num_blocks, hkv, block, dh) for hkv, dh in shapes]
    table = torch.randperm(4 * num_blocks)[:num_blocks]  # a sequence's blocks, scattered in the pool

    def gather():
        for pool in pools:
            for _ in range(2):  # K and V
                pool.index_select(0, table).transpose(0, 1).reshape(pool.shape[1], num_blocks * block, -1)
    return timed(gather, 20)


def decode_step_s(target, context: int) -> float:
    seq = target.new_sequence()
    target.forward([Segment(seq, torch.arange(context - 1) % 1000 + 10, logits="last")])
    step = timed(lambda: (target.forward([Segment(seq, torch.tensor([100]), logits="last")]),
                          target.truncate(seq, context - 1)), 20)
    target.release(seq)
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--context", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--block", type=int, default=64, help="positions per KV block")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    registry = Registry.discover()
    print("| model | paged layers | context | decode step ms | gather ms | gather / step |")
    print("|---|---|---|---|---|---|")
    for model in args.model:
        target = load_target(resolve_model_path(model, registry), registry, threads=args.threads)
        shapes = linear_layer_shapes(target)
        for context in args.context:
            step, gather = decode_step_s(target, context), gather_s(shapes, context, args.block)
            print(f"| {model} | {len(shapes)} | {context} | {step * 1e3:.2f} | {gather * 1e3:.2f} | "
                  f"{gather / step:.0%} |", flush=True)


if __name__ == "__main__":
    main()
