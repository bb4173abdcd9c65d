"""Weight modes side by side on real checkpoints: plain decode speed and teacher-forced argmax
agreement with an fp32 reference (the file dequantised by gguf-py, fp32 linears).

    python benchmarks/weight_modes.py --model gemma3-270m --model smollm2-135m-instruct

Per model: every mode is loaded in one process; decode is timed in rounds (one round: a
128-token prefill per mode, then --steps one-row greedy decodes with the modes taking turns
step by step, median ms per mode), so a load that comes and goes hits every mode alike. Agreement:
the rows of one prefill over the quote-code scenario prompt (chat-rendered), each mode's
argmax against fp32's. Linears: the one-row cost of every linear alone, called in model order
(`linears_ms`): what a weight mode changes, apart from the per-op overhead around it. Prints one markdown row per
(model, mode).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

import torch
from verispec.api import load_registered_trunk, resolve_model_path
from verispec.registry import Registry
from verispec.weights.quant import Float32Linear, PartwiseLinear
from verispec.testing import forward_one


def prompt_tokens(trunk) -> list[int]:
    prompt = json.loads(resources.files("verispec").joinpath("scenarios/quote-code.json").read_text())["prompt"]
    text = trunk.tokenizer.render_chat([{"role": "user", "content": prompt}])
    return trunk.tokenizer.encode(text, add_special=False)


def decode_ms(trunks: dict, tokens: list[int], steps: int) -> dict[str, list[float]]:
    """ms of each one-row greedy decode, per mode, after a 128-token prefill; the modes take
    turns step by step, so a load that comes and goes hits them alike."""
    seqs = {mode: trunk.new_sequence() for mode, trunk in trunks.items()}
    last = {mode: forward_one(t, seqs[mode], tokens[:128], logits="last").logits for mode, t in trunks.items()}
    times = {mode: [] for mode in trunks}
    with torch.inference_mode():
        for _ in range(steps):
            for mode, trunk in trunks.items():
                token = int(last[mode][-1].argmax())
                started = time.perf_counter()
                last[mode] = forward_one(trunk, seqs[mode], [token], logits="last").logits
                times[mode].append(1e3 * (time.perf_counter() - started))
    for mode, trunk in trunks.items():
        trunk.release(seqs[mode])
    return times


def _linears(trunk) -> list:
    """The linears a decode calls, in model order: a PartwiseLinear (a `gguf` stack of mixed
    types) counts as one, not as its parts."""
    parts = {id(p) for m in trunk.modules() if isinstance(m, PartwiseLinear) for p in m}
    return [m for m in trunk.modules() if isinstance(m, (Float32Linear, PartwiseLinear)) and id(m) not in parts]


def linears_ms(trunks: dict, repeats: int) -> dict[str, float]:
    """ms per token spent in the linears alone (LM head included): each linear called on one
    random row, in model order as a decode calls them (so weights stream from memory, not a
    warm cache), median per linear over `repeats` passes, summed; modes take turns pass by pass."""
    linears = {mode: _linears(t) for mode, t in trunks.items()}
    inputs = {mode: [torch.randn(1, m.in_features) for m in modules] for mode, modules in linears.items()}
    times = {mode: [[] for _ in modules] for mode, modules in linears.items()}
    with torch.inference_mode():
        for _ in range(repeats):
            for mode, modules in linears.items():
                for x, linear, spent in zip(inputs[mode], modules, times[mode]):
                    started = time.perf_counter()
                    linear(x)
                    spent.append(time.perf_counter() - started)
    return {mode: 1e3 * sum(map(statistics.median, per_linear)) for mode, per_linear in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--modes", default="gguf,int8,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    registry = Registry.discover()
    print("| model | mode | decode tok/s (median of rounds; per round) | linears ms/token | argmax = fp32 | rows |")
    print("|---|---|---|---|---|---|")
    for model in a.model:
        path = resolve_model_path(model, registry)
        reference = load_registered_trunk(path, registry, dtype="fp32")
        tokens = prompt_tokens(reference)
        with torch.inference_mode():
            expected = forward_one(reference, reference.new_sequence(), tokens).logits.argmax(-1)
        del reference
        trunks = {mode: load_registered_trunk(path, registry, dtype=mode) for mode in a.modes.split(",")}
        agreement = {}
        with torch.inference_mode():
            for mode, trunk in trunks.items():
                got = forward_one(trunk, trunk.new_sequence(), tokens).logits.argmax(-1)
                agreement[mode] = float((got == expected).float().mean())
        rounds = {mode: [] for mode in trunks}
        for _ in range(a.rounds):
            for mode, times in decode_ms(trunks, tokens, a.steps).items():
                rounds[mode].append(1e3 / statistics.median(times))
        linear = {mode: [] for mode in trunks}
        for _ in range(a.rounds):
            for mode, ms in linears_ms(trunks, 9).items():
                linear[mode].append(ms)
        for mode in trunks:
            per_round = ", ".join(f"{x:.1f}" for x in rounds[mode])
            print(f"| {model} | {mode} | {statistics.median(rounds[mode]):.1f} ({per_round}) | "
                  f"{statistics.median(linear[mode]):.1f} | {100 * agreement[mode]:.1f} % | {len(tokens)} |",
                  flush=True)


if __name__ == "__main__":
    main()
