"""Tensor parallelism on this machine: N ranks × 1 thread against 1 process × N threads, same
model, same prompt: prefill and decode tok/s, and the share of a step spent in collectives.

    python benchmarks/tensor_parallel.py                                  # synthetic llama, --tp 2
    python benchmarks/tensor_parallel.py --model smollm2-135m-instruct --tp 3
    python benchmarks/tensor_parallel.py --model qwen2.5-coder-0.5b-instruct --tp 2

The default model is a seeded random llama with SmolLM2-135M's depth and widths (30 blocks,
FFN 1536, vocabulary 49152, tied head, Q8_0 linears) but 8/4 heads of 64 (512 wide), so that 2
ranks divide it (SmolLM2's own 9/3 heads take --tp 3; Qwen2.5-Coder-0.5B's 14/2 take --tp 2).
Random weights change no timing; it is written to a temporary folder each run.

One run holds both setups: the single-process trunk (this process, N torch threads while it
runs) and rank 0 of an N-rank group (this process, 1 thread while it runs; ranks 1..N-1 are
started here the torchrun way, as `--follower` processes with RANK/WORLD_SIZE/MASTER_* set, one
thread each). Each of --rounds rounds runs both, in alternating order, so a load that comes and
goes hits both alike: a prefill of --prompt-tokens tokens (one forward, logits of the last row),
then --steps greedy one-row decodes. tok/s are medians over rounds. Both setups' greedy tokens
are compared (`same tokens`: the world sizes round differently, see verispec.nn.parallel, so a
near-tie may part them).

Communication share: time inside torch.distributed calls (the call broadcast, all-reduces,
all-gathers) over the time of the forward calls, per kind of step, on rank 0 (whole
BroadcastTrunk.forward calls, broadcast included) and on rank 1 (its shard's forward calls; it
writes them to a JSON file when rank 0 closes the group; the warm-up's two forwards are left
out). A rank's collective time includes waiting for the slower rank.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

#: the synthetic default: SmolLM2-135M's shape with 8 heads of 64 and 4 KV heads.
SYNTHETIC = {"blocks": 30, "width": 512, "heads": 8, "kv_heads": 4, "ffn": 1536, "vocab": 49152}


class CollectiveClock:
    """Seconds spent inside torch.distributed's broadcast_object_list, all_reduce and all_gather
    since install() (`inside`), by wrapping them in the module (verispec looks them up per call)."""

    NAMES = ("broadcast_object_list", "all_reduce", "all_gather")

    def __init__(self):
        self.inside = 0.0

    def install(self) -> CollectiveClock:
        import torch.distributed as dist

        for name in self.NAMES:
            setattr(dist, name, self._timed(getattr(dist, name)))
        return self

    def _timed(self, call):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - started
        return timed


def timed_forwards(loader, clock: CollectiveClock, records: list):
    """`loader` whose trunks append (rows, seconds, seconds inside collectives) per forward call."""
    def load(*args, **kwargs):
        trunk = loader(*args, **kwargs)
        forward = trunk.forward

        def timed(batch):
            started, inside = time.perf_counter(), clock.inside
            out = forward(batch)
            records.append((sum(len(s.tokens) for s in batch), time.perf_counter() - started, clock.inside - inside))
            return out
        trunk.forward = timed
        return trunk
    return load


def write_synthetic(path: Path) -> str:
    from verispec.testing.fixture_writer import write_gguf

    c, g = SYNTHETIC, torch.Generator().manual_seed(0)
    head_dim = c["width"] // c["heads"]

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) / inp ** 0.5

    tensors = {"token_embd.weight": torch.randn(c["vocab"], c["width"], generator=g),
               "output_norm.weight": torch.ones(c["width"])}
    for b in range(c["blocks"]):
        tensors |= {f"blk.{b}.attn_norm.weight": torch.ones(c["width"]),
                    f"blk.{b}.attn_q.weight": linear(c["width"], c["width"]),
                    f"blk.{b}.attn_k.weight": linear(c["kv_heads"] * head_dim, c["width"]),
                    f"blk.{b}.attn_v.weight": linear(c["kv_heads"] * head_dim, c["width"]),
                    f"blk.{b}.attn_output.weight": linear(c["width"], c["width"]),
                    f"blk.{b}.ffn_norm.weight": torch.ones(c["width"]),
                    f"blk.{b}.ffn_gate.weight": linear(c["ffn"], c["width"]),
                    f"blk.{b}.ffn_up.weight": linear(c["ffn"], c["width"]),
                    f"blk.{b}.ffn_down.weight": linear(c["width"], c["ffn"])}
    metadata = {"llama.context_length": 2048, "llama.embedding_length": c["width"], "llama.block_count": c["blocks"],
                "llama.feed_forward_length": c["ffn"], "llama.attention.head_count": c["heads"],
                "llama.attention.head_count_kv": c["kv_heads"], "llama.attention.layer_norm_rms_epsilon": 1e-5,
                "llama.rope.freq_base": 10000.0, "llama.vocab_size": c["vocab"],
                "llama.rope.dimension_count": head_dim}
    types = {name: "Q8_0" for name, t in tensors.items() if t.dim() == 2}
    return write_gguf(path, arch="llama", metadata=metadata, tensors=tensors, tensor_types=types)


def model_path(model: str, scratch: Path) -> str:
    if model == "synthetic":
        return write_synthetic(scratch / "synthetic-llama-8x4.gguf")
    from verispec.api import resolve_model_path
    from verispec.registry import Registry

    return resolve_model_path(model, Registry.discover())


def family_loader(path: str):
    from verispec.gguf.io import read_architecture
    from verispec.registry import Registry
    from verispec.specs import resolve

    return resolve(Registry.discover().trunk_for_architecture(read_architecture(path)).loader)


def prompt_tokens(trunk, n: int) -> list[int]:
    text = json.loads(resources.files("verispec").joinpath("scenarios/quote-code.json").read_text())["prompt"]
    ids = trunk.tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def run_once(trunk, prompt: list[int], steps: int, clock: CollectiveClock) -> dict:
    """One prefill and `steps` greedy decodes: seconds and collective seconds of each, the tokens."""
    from verispec.testing import forward_one

    seq = trunk.new_sequence()
    with torch.inference_mode():
        started, inside = time.perf_counter(), clock.inside
        logits = forward_one(trunk, seq, prompt, logits="last").logits
        prefill = (time.perf_counter() - started, clock.inside - inside)
        tokens, decode = [], []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            started, inside = time.perf_counter(), clock.inside
            logits = forward_one(trunk, seq, tokens[-1:], logits="last").logits
            decode.append((time.perf_counter() - started, clock.inside - inside))
    trunk.release(seq)
    return {"prefill": prefill, "decode": decode, "tokens": tokens}


def share(pairs) -> float:
    """Collective seconds over step seconds, summed over (seconds, collective seconds) pairs."""
    total = sum(s for s, _ in pairs)
    return sum(c for _, c in pairs) / total if total else float("nan")


def follower(args) -> int:
    """Rank 1..N-1: follow rank 0; at its close, write (rows, s, collective s) per forward to args.stats."""
    from verispec.tensor_parallel import load_parallel_trunk

    torch.set_num_threads(1)
    clock, records = CollectiveClock().install(), []
    try:
        load_parallel_trunk(timed_forwards(family_loader(args.model), clock, records), args.model,
                            world_size=int(os.environ["WORLD_SIZE"]), dtype=args.dtype, threads=1)
    except SystemExit:
        pass
    Path(args.stats).write_text(json.dumps(records))
    return 0


def spawn_followers(path: str, tp: int, dtype: str | None, scratch: Path) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(tp), RANK="0")
    followers = []
    for rank in range(1, tp):
        env = dict(os.environ, RANK=str(rank), OMP_NUM_THREADS="1")
        command = [sys.executable, __file__, "--follower", "--model", path, "--stats", str(scratch / f"rank{rank}.json")]
        followers.append(subprocess.Popen(command + (["--dtype", dtype] if dtype else []), env=env))
    return followers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic", help="checkpoint alias, GGUF path, or synthetic (default)")
    ap.add_argument("--tp", type=int, default=2, help="ranks; the single process gets as many threads")
    ap.add_argument("--dtype", help="weight dtype (default: the family's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="greedy one-row decodes per round")
    ap.add_argument("--follower", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.follower:
        return follower(args)

    from verispec.tensor_parallel import load_parallel_trunk

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        path = model_path(args.model, scratch)
        loader = family_loader(path)
        clock = CollectiveClock().install()
        single = loader(path, dtype=args.dtype)
        followers = spawn_followers(path, args.tp, args.dtype, scratch)
        torch.set_num_threads(1)
        group = load_parallel_trunk(loader, path, world_size=args.tp, dtype=args.dtype, threads=1)
        setups = {f"1 process × {args.tp} threads": (single, args.tp), f"{args.tp} ranks × 1 thread": (group, 1)}
        prompt = prompt_tokens(single, args.prompt_tokens)
        for trunk, threads in setups.values():  # warm-up: one prefill, one decode (rank 1 drops both)
            torch.set_num_threads(threads)
            run_once(trunk, prompt[:16], 1, clock)
        runs = {name: [] for name in setups}
        for r in range(args.rounds):
            for name in list(setups)[::1 if r % 2 == 0 else -1]:
                trunk, threads = setups[name]
                torch.set_num_threads(threads)
                runs[name].append(run_once(trunk, prompt, args.steps, clock))
        group.close()
        for p in followers:
            p.wait(timeout=120)
        rank1 = json.loads((scratch / "rank1.json").read_text())[2:]
        report(args, path, runs, rank1)
    return 0


def report(args, path: str, runs: dict, rank1: list) -> None:
    print(f"model {args.model} ({os.path.basename(path)}, {os.path.getsize(path) / 2**20:.0f} MiB), dtype {args.dtype or 'default'}, {args.rounds} round(s) of "
          f"{args.prompt_tokens}-token prefill + {args.steps} decodes\n")
    print("| setup | prefill tok/s | decode tok/s | collectives / prefill step (rank 0, rank 1) "
          "| collectives / decode step (rank 0, rank 1) |")
    print("|---|---:|---:|---:|---:|")
    for i, (name, rounds) in enumerate(runs.items()):
        prefill = statistics.median(args.prompt_tokens / r["prefill"][0] for r in rounds)
        decode = statistics.median(len(r["decode"]) / sum(s for s, _ in r["decode"]) for r in rounds)
        if i == 0:
            comm = ("-", "-")
        else:
            ours = (share([r["prefill"] for r in rounds]), share([d for r in rounds for d in r["decode"]]))
            theirs = (share([(s, c) for rows, s, c in rank1 if rows > 1]),
                      share([(s, c) for rows, s, c in rank1 if rows == 1]))
            comm = tuple(f"{a:.0%}, {b:.0%}" for a, b in zip(ours, theirs))
        print(f"| {name} | {prefill:.0f} | {decode:.1f} | {comm[0]} | {comm[1]} |")
    a, b = ([r["tokens"] for r in rounds] for rounds in runs.values())
    print(f"\nsame greedy tokens in every round: {'yes' if a == b else 'no (a near-tie parted them)'}")


if __name__ == "__main__":
    sys.exit(main())
