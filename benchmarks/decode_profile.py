"""Where a one-row plain decode spends its time: ms per token by component.

docs/benchmarks.md "Decode cost per token" holds the figures.

    python benchmarks/decode_profile.py --model gemma3-270m --model smollm2-135m-instruct [--threads 1]

Per model and way of running the layers (op by op with the C kernels, or fused: the layers in
one C call, nn.layers): a 128-token prefill, then --steps one-row decodes timed whole (the step),
then as many with every call wrapped in a timer: head = the LM head, other linears = every
other linear call, attention = the family's `attend_rows` (cache write + attend), fused layers
= the nn.layers calls (everything a layer does), rest = the step minus those (op by op: norms,
RoPE, residuals, activations; both: embedding, Python, bookkeeping). Repeated --rounds times,
the two ways taking turns; medians. With --threads 1 the clock is the thread's CPU time, which a loaded
machine barely moves; otherwise wall time (2 threads on a shared machine swing widely).

    python benchmarks/decode_profile.py --model M --verify 2 3 5 9

instead prints what a k-row verify forward (logits for every row, after a 200-token prompt,
fused layers) costs relative to a one-row decode: the "row cost" speculation pays per draft.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from verispec.api import load_registered_trunk, resolve_model_path
from verispec.nn.layers import DecoderLayerKernel
from verispec.weights.quant import Float32Linear
from verispec.registry import Registry
from verispec.seams import Segment

COMPONENTS = ("step", "head", "other linears", "attention", "fused layers", "rest")


class Timers:
    """Wraps the trunk's LM head, linear classes and `attend_rows` with accumulating timers."""

    def __init__(self, trunk, clock):
        self.trunk, self.clock = trunk, clock
        self.ms = dict.fromkeys(("head", "linears", "attention", "fused"), 0.0)
        self._linears = {type(m): type(m).forward for m in trunk.modules() if isinstance(m, Float32Linear)}
        self._families = [m for name, m in sys.modules.items()
                          if name.startswith("verispec_") and hasattr(m, "attend_rows")]

    def _timed(self, fn, key):
        def wrapped(*args, **kwargs):
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[key] += (self.clock() - started) * 1e3
        return wrapped

    def reset(self) -> None:
        self.ms = dict.fromkeys(self.ms, 0.0)

    def __enter__(self):
        for cls, forward in self._linears.items():
            cls.forward = self._timed(forward, "linears")
        self._attend = self._families[0].attend_rows
        for module in self._families:
            module.attend_rows = self._timed(self._attend, "attention")
        self.trunk._lm_head = self._timed(type(self.trunk)._lm_head.__get__(self.trunk), "head")
        self._fused = DecoderLayerKernel.run
        DecoderLayerKernel.run = staticmethod(self._timed(self._fused, "fused"))
        return self

    def __exit__(self, *exc):
        for cls, forward in self._linears.items():
            cls.forward = forward
        for module in self._families:
            module.attend_rows = self._attend
        del self.trunk._lm_head
        DecoderLayerKernel.run = staticmethod(self._fused)


def decode_steps(trunk, steps: int, clock, timers: Timers | None = None) -> list[float]:
    """ms of each of `steps` one-row decodes after a 128-token prefill (token ids are arbitrary);
    `timers` count the decodes only."""
    seq = trunk.new_sequence()
    trunk.forward([Segment(seq, torch.arange(10, 138), logits="last")])
    if timers is not None:
        timers.reset()
    times = []
    for _ in range(steps):
        started = clock()
        trunk.forward([Segment(seq, torch.tensor([100]), logits="last")])
        times.append((clock() - started) * 1e3)
    trunk.release(seq)
    return times


def profile(trunk, steps: int, clock) -> dict[str, float]:
    """One round: {component: ms per token}."""
    step = statistics.median(decode_steps(trunk, steps, clock))
    with Timers(trunk, clock) as timers:
        decode_steps(trunk, steps, clock, timers)
    head = timers.ms["head"] / steps
    other = timers.ms["linears"] / steps - head  # the head's own linear call is counted in both
    attention, fused = timers.ms["attention"] / steps, timers.ms["fused"] / steps
    return {"step": step, "head": head, "other linears": other, "attention": attention, "fused layers": fused,
            "rest": step - head - other - attention - fused}


def verify_costs(trunk, widths: list[int], clock, rounds: int) -> dict[int, float]:
    """Median ms of a k-row verify forward per k in widths (1 included), the widths taking turns."""
    seq = trunk.new_sequence()
    trunk.forward([Segment(seq, torch.arange(10, 210), logits="last")])
    ms = {k: [] for k in [1, *widths]}
    for _ in range(rounds):
        for k in ms:
            started = clock()
            trunk.forward([Segment(seq, torch.arange(300, 300 + k), logits="all", verify=True)])
            ms[k].append((clock() - started) * 1e3)
            trunk.keep(seq, 0)  # every row rejected: back to the 200-token prompt
    trunk.release(seq)
    return {k: statistics.median(v) for k, v in ms.items()}


def set_fused(trunk, fused: bool) -> None:
    """Run the family's layers fused (nn.layers: consecutive layers in one C call) or op by op, where it
    has both."""
    for layer in trunk.model.layers:
        if hasattr(layer, "fused"):
            layer.fused = fused


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoint alias or GGUF path (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--verify", type=int, nargs="+", metavar="K", help="verify widths to cost instead")
    args = parser.parse_args(argv)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    registry = Registry.discover()
    if args.verify:
        print("| model | threads | 1 row, ms | " + " | ".join(f"{k} rows" for k in args.verify) + " |")
        print("|---" * (len(args.verify) + 3) + "|")
        for model in args.model or [None]:
            trunk = load_registered_trunk(resolve_model_path(model, registry), registry, threads=args.threads)
            verify_costs(trunk, args.verify, clock, 2)  # warm-up
            ms = verify_costs(trunk, args.verify, clock, 5 * args.rounds)
            print(f"| {model or 'default'} | {args.threads} | {ms[1]:.2f} | "
                  + " | ".join(f"{ms[k] / ms[1]:.2f}x" for k in args.verify) + " |", flush=True)
        return
    print("| model | threads | layers | " + " | ".join(COMPONENTS) + " | tok/s |")
    print("|---" * (len(COMPONENTS) + 4) + "|")
    for model in args.model or [None]:
        trunk = load_registered_trunk(resolve_model_path(model, registry), registry, threads=args.threads)
        decode_steps(trunk, 3, clock)  # warm-up
        rounds = {False: [], True: []}
        for _ in range(args.rounds):  # the two ways take turns, so a passing load hits both
            for fused in rounds:
                set_fused(trunk, fused)
                rounds[fused].append(profile(trunk, args.steps, clock))
        for fused, results in rounds.items():
            med = {c: statistics.median(r[c] for r in results) for c in COMPONENTS}
            # "-": a call this way does not make (what is left is the timers' noise)
            untimed = {"other linears", "attention"} if fused else {"fused layers"}
            print(f"| {model or 'default'} | {args.threads} | {'fused' if fused else 'op by op'} | "
                  + " | ".join("-" if c in untimed and abs(med[c]) < 0.05 else f"{med[c]:.2f}" for c in COMPONENTS)
                  + f" | {1000 / med['step']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
