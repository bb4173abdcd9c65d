"""Session scenarios (not a test): ordered requests through one engine, plain vs ngram vs suffix.

A session is a list of requests run one after another through the same engine, so the suffix
drafter's engine-wide index holds the earlier requests' outputs when a later one runs. Each request
is a function of the earlier answers' texts (an agent re-quoting code it wrote). For every spec type
the engine gets a fresh speculator (empty index) and an empty prefix cache at the start of each
session. Prints per-request decode tok/s, the whole session's decode tok/s (tokens / decode time),
the speedup over plain and over ngram, and whether every stream equals plain's (it must). With --rounds N the
spec types take turns N times per scenario (plain, ngram, suffix, plain, ...); the figures are
medians over the rounds (x_plain: the median of each round's ratio to that round's plain), and
"identical" must hold in every round.

    python plugins/suffix/benchmarks/sessions.py [--model smollm2-135m-instruct] [--max-tokens 96]
        [--spec-types ngram suffix] [--scenarios three-users regenerate ...] [--adaptive on|off]
        [--rounds 3] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import verispec
from verispec.engine import SpecOptions


def user(text):
    return [{"role": "user", "content": text}]


QUESTION = "How do I reverse a list in Python? Give two ways, each with a one-line example."
SCHEMA = ('Extract {"name": string, "city": string, "age": integer} from the text and reply with the JSON '
          "object only.\n\nText: ")
PEOPLE = ["Maria Lopez, 34, moved to Valencia last spring.", "In Oslo lives Erik Hansen, who is 52.",
          "Aiko Tanaka (27) works in Osaka as a nurse.", "The baker of Lyon, Pierre Martin, turned 61.",
          "Chidi Okafor is 45 and runs a shop in Lagos."]
CODE_TASK = "Write a Python function `moving_average(xs, k)` returning the list of means of each window of k items."

#: scenario -> requests; a request is a function of the earlier answers' texts returning chat messages.
SCENARIOS = {
    "single": [lambda prev: user(QUESTION)],  # nothing earlier to draft from: must not lose to plain
    "three-users": [lambda prev: user(QUESTION)] * 3,
    "json-extractions": [lambda prev, p=p: user(SCHEMA + p) for p in PEOPLE],
    "regenerate": [lambda prev: user(CODE_TASK)] * 2,
    "agent-requote": [
        lambda prev: user(CODE_TASK),
        lambda prev: user(f"Here is your code:\n\n{prev[0]}\n\nAdd type hints and a docstring; reply with the code only."),
        lambda prev: user(f"Here is the code:\n\n{prev[1]}\n\nRaise ValueError when k < 1; reply with the code only."),
        lambda prev: user(f"Here is the code:\n\n{prev[2]}\n\nWrite three pytest tests for it."),
    ],
}


def run_session(engine, requests, spec: SpecOptions, max_tokens: int) -> list[dict]:
    engine.update_speculation(spec)  # a fresh speculator: the engine-wide index starts empty
    engine.reset_cache()
    texts, rows = [], []
    for make in requests:
        generation = engine.generate(make(texts), max_tokens=max_tokens)
        tokens = [event.token for event in generation]
        result = generation.result
        texts.append(result.text)
        rows.append({"tokens": tokens, "tok_s": result.decode_tokens_per_s,
                     "decode_s": len(tokens) / result.decode_tokens_per_s if result.decode_tokens_per_s else 0.0,
                     "drafted": result.spec.num_draft_tokens, "accepted": result.spec.num_accepted_tokens})
    return rows


def _decode_s(rows: list[dict]) -> float:
    """Seconds of decoding of a session's requests (run_session's rows)."""
    return sum(row["decode_s"] for row in rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--spec-types", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--adaptive", choices=("on", "off"), default="on")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; figures are medians")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    engine = verispec.load(args.model, enabled=False, kv_cache_gb=0, threads=args.threads)
    report = {}
    for name in args.scenarios:
        rounds = []
        for _ in range(args.rounds):
            runs = {"plain": run_session(engine, SCENARIOS[name], SpecOptions(enabled=False), args.max_tokens)}
            for spec_type in args.spec_types:
                runs[spec_type] = run_session(engine, SCENARIOS[name],
                                              SpecOptions(spec_type=spec_type, adaptive=args.adaptive == "on"),
                                              args.max_tokens)
            rounds.append(runs)
        plain_tokens = [row["tokens"] for row in rounds[0]["plain"]]
        report[name] = {}
        for spec_type in rounds[0]:
            per_round = []
            for runs in rounds:
                rows = runs[spec_type]
                seconds = _decode_s(rows) or math.inf  # no decode time: speeds and ratios 0
                per_round.append({"tok_s": sum(len(row["tokens"]) for row in rows) / seconds,
                                  "x_plain": _decode_s(runs["plain"]) / seconds,
                                  "x_ngram": _decode_s(runs.get("ngram", rows)) / seconds,
                                  "identical": [row["tokens"] for row in rows] == plain_tokens})
            last = rounds[-1][spec_type]
            report[name][spec_type] = {
                "per_request_tok_s": [round(row["tok_s"], 1) for row in last],
                "session_tok_s": round(statistics.median(r["tok_s"] for r in per_round), 1),
                "x_plain": round(statistics.median(r["x_plain"] for r in per_round), 2),
                "x_ngram": round(statistics.median(r["x_ngram"] for r in per_round), 2),
                "accepted/drafted": [f"{row['accepted']}/{row['drafted']}" for row in last],
                "identical": all(r["identical"] for r in per_round),
            }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, by_spec in report.items():
        print(name)
        for spec_type, e in by_spec.items():
            print(f"  {spec_type:8} session {e['session_tok_s']:7.1f} tok/s  x{e['x_plain']:<5} (x{e['x_ngram']} ngram) "
                  f"identical={e['identical']}  per request {e['per_request_tok_s']}  {e['accepted/drafted']}")


if __name__ == "__main__":
    main()
