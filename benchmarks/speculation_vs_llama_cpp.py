"""Speculation with a second file, verispec vs llama.cpp, on the same two GGUF files: a draft model
(`llama-speculative`) or a DFlash drafter (`llama-speculative-simple --spec-type draft-dflash`).

    python benchmarks/llama_cpp.py --build              # once: also builds both llama.cpp tools
    python benchmarks/speculation_vs_llama_cpp.py       # Qwen2.5-Coder 0.5B drafting for 1.5B, 2 threads
    python benchmarks/speculation_vs_llama_cpp.py --spec-type block \
        --target smollm2-135m-instruct --draft dflash-smollm2-135m-instruct   # the bundled DFlash drafter

Per scenario (the shared quote-code, quote-text and prose, plus a code edit written here), the
systems run one after the other inside each round, rounds interleaved, greedy, the same
chat-rendered prompt:
- llama.cpp plain: `llama-bench -p 0 -n 128` (tg128), once per round;
- llama.cpp `llama-speculative -m TARGET -md DRAFT --temp 0` (`--spec-type block`:
  `llama-speculative-simple ... --spec-type draft-dflash`) at --spec-draft-n-max 3 (its default),
  8 and 16; if llama.cpp refuses the files, its error is printed and the round goes on;
- verispec plain, `draft-model` (or `block`) and `ngram` (`verispec.bench.run.run_scenario`, a fresh
  cache each).
Each row: decode tok/s as the tool reports it (llama-speculative's excludes both models' prompt
evaluation; ours starts at the first token, so it includes the drafter's catch-up over the
prompt), end-to-end tok/s (new tokens / (prompt + decode time)), acceptance, and for ours
whether the speculative stream equals our plain stream. One JSON line per row; medians over
rounds at the end. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_cpp import built, llama_bench  # noqa: E402 (this directory's build helper)

CODE_EDIT = {
    "name": "code-edit", "kind": "edit", "max_new_tokens": 128,
    "prompt": ("Here is a Python function:\n\n```python\ndef mean(values):\n    total = 0\n    count = 0\n"
               "    for value in values:\n        total += value\n        count += 1\n    if count == 0:\n"
               "        return 0.0\n    return total / count\n```\n\nRename `total` to `running_sum` and "
               "`count` to `num_values`, add type hints, and reply with the whole function only.\n"),
}


#: our --spec-type -> (llama.cpp tool, its extra arguments)
LLAMA_CPP_TOOLS = {"draft-model": ("llama-speculative", []),
                   "block": ("llama-speculative-simple", ["--spec-type", "draft-dflash"])}


def speculative_binary(tool: str) -> Path:
    binary = built(tool)
    if binary is None:
        raise FileNotFoundError(f"{tool} is not built: run `python benchmarks/llama_cpp.py --build`")
    return binary


def llama_speculative(target: str, draft: str, prompt: str, n: int, draft_max: int, threads: int,
                      spec_type: str = "draft-model") -> dict:
    """One llama.cpp speculative run; its own figures parsed from its log. Raises RuntimeError with
    the tail of its log when it refuses the files."""
    tool, extra = LLAMA_CPP_TOOLS[spec_type]
    done = subprocess.run([str(speculative_binary(tool)), "-m", target, "-md", draft, "-p", prompt, "-n", str(n),
                           "--temp", "0", "--spec-draft-n-max", str(draft_max), "-t", str(threads), "-td", str(threads),
                           "-c", "4096", *extra],
                          capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode or not re.search(r"decoded\s+\d+ tokens", log):
        tail = "\n".join(line for line in log.splitlines() if line.strip())
        raise RuntimeError(f"{tool} exited {done.returncode}:\n" + "\n".join(tail.splitlines()[-12:]))
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+)", log)
    drafted = int(re.search(r"n_drafted = (\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s+= (\d+)", log).group(1))
    new, total_s = int(dec.group(1)), float(enc.group(2)) + float(dec.group(2))
    return {"decode_tps": float(dec.group(3)), "e2e_tps": new / total_s, "new_tokens": new,
            "drafted": drafted, "accepted": accepted}


def ours(engine, scenario: dict, spec) -> tuple[dict, list[int]]:
    from verispec.bench.run import run_scenario

    engine.update_speculation(spec)
    run = run_scenario(engine, scenario)
    new = len(run.tokens)
    total_s = run.ttft_ms / 1e3 + run.decode_s
    return ({"decode_tps": run.decode_tps, "e2e_tps": new / total_s, "new_tokens": new,
             "drafted": run.drafted, "accepted": run.accepted, "governor": run.governor}, run.tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--scenarios", nargs="+", default=["quote-code", "quote-text", "prose", "code-edit"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", type=int, nargs="+", default=[3, 8, 16])
    parser.add_argument("--spec-type", choices=sorted(LLAMA_CPP_TOOLS), default="draft-model",
                        help="draft-model: --draft is a small model; block: --draft is a DFlash drafter")
    parser.add_argument("--no-llama-cpp", action="store_true", help="verispec only")
    args = parser.parse_args()

    import verispec
    from verispec.api import resolve_model_path
    from verispec.bench.run import load_scenarios
    from verispec.engine import SpecOptions
    from verispec.registry import Registry

    registry = Registry.discover()
    target, draft = (resolve_model_path(m, registry) for m in (args.target, args.draft))
    engine = verispec.load(target, threads=args.threads, registry=registry, enabled=False)
    shared = [s for s in load_scenarios() if s["name"] in args.scenarios]
    scenarios = shared + ([CODE_EDIT] if "code-edit" in args.scenarios else [])
    systems = {"verispec plain": SpecOptions(enabled=False),
               f"verispec {args.spec_type}": SpecOptions(spec_type=args.spec_type, draft_model=draft),
               "verispec ngram": SpecOptions(spec_type="ngram")}
    rows: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        if not args.no_llama_cpp:
            tg = llama_bench(target, args.threads, repetitions=1)["llama_cpp_tg128"]
            rows.setdefault(("tg128", "llama.cpp plain"), []).append({"decode_tps": tg})
            print(json.dumps({"round": round_, "scenario": "tg128", "system": "llama.cpp plain",
                              "decode_tps": round(tg, 2)}), flush=True)
        for scenario in scenarios:
            prompt = engine.tokenizer.render_chat([{"role": "user", "content": scenario["prompt"]}])
            results = {}
            plain_tokens = None
            for name, spec in systems.items():
                figures, tokens = ours(engine, scenario, spec)
                if plain_tokens is None:
                    plain_tokens = tokens
                figures["identical"] = tokens == plain_tokens
                results[name] = figures
            if not args.no_llama_cpp:
                for draft_max in args.draft_max:
                    try:
                        results[f"llama.cpp {args.spec_type} n-max {draft_max}"] = llama_speculative(
                            target, draft, prompt, scenario["max_new_tokens"], draft_max, args.threads,
                            args.spec_type)
                    except RuntimeError as refusal:
                        print(f"llama.cpp refused ({scenario['name']}, n-max {draft_max}): {refusal}", flush=True)
            for name, figures in results.items():
                rows.setdefault((scenario["name"], name), []).append(figures)
                print(json.dumps({"round": round_, "scenario": scenario["name"], "system": name,
                                  **{k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}}),
                      flush=True)
    print("\nmedians over rounds: scenario | system | decode tok/s | end-to-end tok/s | acceptance | identical")
    for (scenario, name), runs in rows.items():
        decode = statistics.median(r["decode_tps"] for r in runs)
        e2e = statistics.median(r["e2e_tps"] for r in runs) if "e2e_tps" in runs[0] else float("nan")
        drafted = sum(r.get("drafted", 0) for r in runs)
        accepted = sum(r.get("accepted", 0) for r in runs)
        acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
        identical = all(r["identical"] for r in runs) if "identical" in runs[0] else "-"
        print(f"{scenario} | {name} | {decode:.2f} | {e2e:.2f} | {acceptance} | {identical}")


if __name__ == "__main__":
    main()
