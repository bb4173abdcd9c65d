"""`verispec bench`: plain vs speculative decoding on named scenarios, side by side in one process.

Per scenario, greedy, stop tokens ignored so both runs decode the same number of tokens:
the cache is emptied, a plain run decodes, the cache is emptied again, a speculative run
decodes; `identical` compares the two token streams (our own plain greedy, same process,
same dtype). Speeds are ratios from the same run, never absolute claims. Multi-turn
scenarios send each turn after the model's previous answer, so the second turn reuses the
cached prefix as a chat would. Chat models (a GGUF with a chat template) get each prompt
rendered through it.

On a terminal a progress bar on stderr names the scenario (i/n) and the phase (plain or spec);
it is silent when stderr is not a terminal. `--plot` draws the rows and one scenario's
per-step trace (verispec.bench.plot); `--diagnostic` runs the teacher-forced row check instead
(verispec.bench.diagnostic).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import attrs

from verispec.engine import SpecOptions
from verispec.errors import InvalidArgument


def load_scenarios(names=None) -> list[dict]:
    """The bundled scenarios (verispec/scenarios/*.json), all or those named, in order. A name
    ending in `.json` is a file of one scenario object or a list of them (`read_scenario_file`).
    Raises InvalidArgument naming an unknown name or a file that is not a scenario file."""
    folder = resources.files("verispec") / "scenarios"
    scenarios = {s["name"]: s for s in (json.loads(p.read_text()) for p in folder.iterdir() if p.name.endswith(".json"))}
    if not names:
        return [scenarios[n] for n in sorted(scenarios)]
    unknown = sorted(n for n in names if n not in scenarios and not n.endswith(".json"))
    if unknown:
        raise InvalidArgument(f"unknown scenario(s) {unknown}; choose from {sorted(scenarios)}, or give a "
                              "FILE.json of your own (docs/benchmarks.md, 'Held-out prompts')")
    return [s for n in names for s in (read_scenario_file(n) if n.endswith(".json") else [scenarios[n]])]


def read_scenario_file(path: str) -> list[dict]:
    """Scenarios from a JSON file: one object or a list of objects, each with "name" (str),
    "prompt" (str) or "turns" (a list of str: each sent after the model's previous answer),
    "max_new_tokens" (int >= 1) and optionally "kind" (str, default "custom"). Raises
    InvalidArgument naming the file, the scenario and the field that is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidArgument(f"--scenario {path}: cannot read it ({e.strerror or e}); give a readable JSON file") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"--scenario {path}: not JSON ({e}); give a scenario object or a list of them") from e
    items = data if isinstance(data, list) else [data]
    if not items:
        raise InvalidArgument(f"--scenario {path}: an empty list; give at least one scenario")
    out = []
    for i, item in enumerate(items):
        where = f"--scenario {path}, scenario {i}"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where}: a {type(item).__name__}; each scenario is a JSON object")
        if not isinstance(item.get("name"), str) or not item["name"]:
            raise InvalidArgument(f"{where}: \"name\" must be a non-empty string")
        where = f"--scenario {path}, scenario {item['name']!r}"
        turns = item.get("turns", [item.get("prompt")])
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise InvalidArgument(f"{where}: give \"prompt\" (a non-empty string) or \"turns\" (a list of them)")
        budget = item.get("max_new_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InvalidArgument(f"{where}: \"max_new_tokens\" must be an integer >= 1, not {budget!r}")
        kind = item.get("kind", "custom")
        if not isinstance(kind, str):
            raise InvalidArgument(f"{where}: \"kind\" must be a string, not {kind!r}")
        out.append({**item, "kind": kind})
    return out


@attrs.define
class RunStats:
    tokens: list[int]
    prompt_tokens: int
    ttft_ms: float
    decode_s: float
    drafted: int
    accepted: int
    governor: str | None
    #: step_stats.StepRecords of every turn, when asked for (run_scenario's `steps`).
    steps: list | None = None

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def run_scenario(engine, scenario: dict, steps: list | None = None) -> RunStats:
    """Decode a scenario from an empty cache; multi-turn answers feed the next turn.
    steps: a list that receives every turn's step_stats.StepRecords, in order (speculative runs)."""
    engine.reset_cache()
    chat = engine.tokenizer.chat_template is not None
    turns = scenario.get("turns") or [scenario["prompt"]]
    messages, text, tokens = [], "", []
    stats = RunStats([], 0, 0.0, 0.0, 0, 0, None, steps)
    for i, turn in enumerate(turns):
        if chat:
            messages.append({"role": "user", "content": turn})
            prompt = messages
        else:
            text += turn
            prompt = text
        generation = engine.generate(prompt, max_tokens=scenario["max_new_tokens"], ignore_eos=True)
        generation.step_records = steps
        for _ in generation:
            pass
        r = generation.result
        if chat:
            messages.append({"role": "assistant", "content": r.text})
        else:
            text += r.text
        tokens += r.tokens
        if i == 0:
            stats.prompt_tokens, stats.ttft_ms = r.prompt_tokens, r.ttft_ms
        if r.decode_tokens_per_s:
            stats.decode_s += (len(r.tokens) - 1) / r.decode_tokens_per_s
        stats.drafted += r.spec.num_draft_tokens
        stats.accepted += r.spec.num_accepted_tokens
        stats.governor = r.governor
    stats.tokens = tokens
    return stats


def compare(engine, scenario: dict, spec: SpecOptions, repeats: int = 1, *, trace: list | None = None,
            on_phase: Callable[[str], None] | None = None) -> dict:
    """One row of the bench: plain then speculative, `repeats` times, medians of speeds.

    trace: a list that receives the last speculative run's step_stats.StepRecords.
    on_phase: called with "plain" or "spec" before each run (the progress bar)."""
    plain_runs, spec_runs = [], []
    for repeat in range(repeats):
        if on_phase:
            on_phase("plain")
        engine.update_speculation(SpecOptions(enabled=False))
        plain_runs.append(run_scenario(engine, scenario))
        if on_phase:
            on_phase("spec")
        engine.update_speculation(spec)
        last = trace is not None and repeat == repeats - 1
        spec_runs.append(run_scenario(engine, scenario, steps=[] if last else None))
        if last:
            trace.extend(spec_runs[-1].steps)
    plain, fast = plain_runs[0], spec_runs[-1]
    plain_tps = statistics.median(r.decode_tps for r in plain_runs)
    spec_tps = statistics.median(r.decode_tps for r in spec_runs)
    return {
        "scenario": scenario["name"], "kind": scenario["kind"], "prompt_tokens": plain.prompt_tokens,
        "new_tokens": len(fast.tokens), "ttft_ms": round(statistics.median(r.ttft_ms for r in spec_runs), 1),
        "plain_decode_tps": round(plain_tps, 2), "spec_decode_tps": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3) if plain_tps else None,
        "drafted": fast.drafted, "accepted": fast.accepted,
        "identical": all(r.tokens == plain.tokens for r in plain_runs + spec_runs),
        "governor": fast.governor,
        "cost_model": engine.cost_summary(),
    }


HEADER = ("scenario", "prompt", "new", "ttft ms", "plain tok/s", "spec tok/s", "speedup", "drafted", "accepted",
          "identical")


def format_row(r: dict) -> str:
    return " | ".join(str(r[k]) for k in ("scenario", "prompt_tokens", "new_tokens", "ttft_ms", "plain_decode_tps",
                                           "spec_decode_tps", "speedup", "drafted", "accepted", "identical"))


def format_table(rows: list[dict]) -> str:
    """The human table: a header, a row per scenario, then each scenario's governor and cost-model lines."""
    lines = [" | ".join(HEADER), *map(format_row, rows)]
    return "\n".join(lines + footer(rows))


def footer(rows: list[dict]) -> list[str]:
    """Each scenario's governor line, then the cost model the engine measured (verispec.cost_model)."""
    lines = [f"{r['scenario']}: {r['governor']}" for r in rows if r["governor"]]
    costs = next((r["cost_model"] for r in reversed(rows) if r.get("cost_model")), None)
    if costs:
        forward = " ".join(f"{n}:{ms:.2f}" for n, ms in costs["forward_ms"].items())
        propose = " ".join(f"{k}:{ms:.3f}" for k, ms in costs["propose_ms"].items()) or "-"
        lines.append(f"cost model: forward ms by rows {forward}; propose ms by k {propose}; "
                     f"upkeep {costs['upkeep_ms_per_row']:.4f} ms/row")
    return lines


def run_bench(engine, spec: SpecOptions, scenarios: list[dict], *, max_tokens: int | None = None, repeats: int = 1,
              as_json: bool = False, plot: str | None = None) -> int:
    """`verispec bench`: warm up, compare every scenario (`load_scenarios`) on one loaded engine,
    print a table or JSON; with `plot` (a .png path) also draw them (verispec.bench.plot).
    Returns 0, or 3 when a speculative stream differed from plain."""
    from tqdm.auto import tqdm

    warm = {"name": "warm-up", "kind": "short", "max_new_tokens": 8, "prompt": "Warm up."}
    compare(engine, warm, spec)
    rows, traces = [], {}

    def say(line: str) -> None:  # above the bar on a terminal; each row reaches a pipe as it is measured
        tqdm.write(line)
        sys.stdout.flush()
    if not as_json:
        say(" | ".join(HEADER))
    # disable=None: drawn only when stderr is a terminal
    with tqdm(total=len(scenarios), desc="bench", unit="scenario", disable=None, leave=False) as bar:
        for i, scenario in enumerate(scenarios):
            if max_tokens:
                scenario = {**scenario, "max_new_tokens": max_tokens}

            def phase(name, i=i, scenario=scenario):
                bar.set_description(f"bench {i + 1}/{len(scenarios)} {scenario['name']}: {name}")
            traces[scenario["name"]] = [] if plot else None
            rows.append(compare(engine, scenario, spec, repeats=repeats, trace=traces[scenario["name"]],
                                on_phase=phase))
            bar.update()
            if not as_json:
                say(format_row(rows[-1]))
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        print("\n".join(footer(rows)))
    if plot:
        from verispec.bench.plot import plot_bench, trace_scenario

        name = trace_scenario(rows)
        plot_bench(rows, name, traces[name], plot)
        print(f"plot: {plot} (trace: {name})", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows) else 3
