"""`verispec serve` with N concurrent clients (the real `openai` package), speculation off vs on:
every response is checked equal to its solo plain response, and the aggregate throughput
(completion tokens / wall time of the whole wave) is reported per mode.

    python benchmarks/serve_clients.py [--model smollm2-135m-instruct] [--clients 8] [--new 96]
                                       [--rounds 3] [--spec-type auto] [--prompts quoting|sessions]
                                       [--waves 1]

--prompts quoting: the bundled quoting scenarios, each behind its own first line. sessions: the
requests of plugins/suffix/benchmarks/sessions.py's scenarios (a question, a coding task, JSON
extractions in one schema), and --waves 2 sends the same wave again once the first has finished
(the same questions from other users, or regenerated), so a drafter that learns across requests
has the first wave's answers. Each round starts from a fresh speculator and an empty prefix cache.

The server runs in this process (uvicorn on a loopback port, one engine thread); off and on
alternate in interleaved rounds (`update_speculation`, no reload) and the median wave is reported.
Not a test: timings are wall clock on this machine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import verispec
from verispec.bench.run import load_scenarios
from verispec.engine import SpecOptions
from verispec.server import create_app
from verispec.testing.serving import serving


def quoting_prompts(count: int) -> list[str]:
    """`count` chat prompts that ask to copy or edit their input (the bundled quoting scenarios),
    each behind its own first line."""
    scenarios = {s["name"]: s.get("prompt") or s["turns"][0] for s in load_scenarios()}
    texts = [scenarios[n] for n in ("quote-code", "quote-text", "json-edit")]
    return [f"Client {i + 1}.\n{texts[i % len(texts)]}" for i in range(count)]


def session_prompts(count: int) -> list[str]:
    """`count` prompts from the session scenarios' requests (those that need no earlier answer)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "plugins" / "suffix" / "benchmarks" / "sessions.py"
    spec = importlib.util.spec_from_file_location("sessions", path)
    sessions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sessions)
    texts = [sessions.QUESTION, sessions.CODE_TASK, *(sessions.SCHEMA + p for p in sessions.PEOPLE)]
    return [texts[i % len(texts)] for i in range(count)]


def wave(base_url: str, prompts: list[str], new: int) -> tuple[list[str], int, float]:
    """Every prompt at once from its own client; (texts, completion tokens, seconds)."""
    import openai

    def one(prompt):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
        r = client.chat.completions.create(model="served", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=new, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    return [t for t, _ in results], sum(n for _, n in results), time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--spec-type", default="auto")
    parser.add_argument("--prompts", choices=("quoting", "sessions"), default="quoting")
    parser.add_argument("--waves", type=int, default=1, help="the same wave again, after the one before finished")
    args = parser.parse_args(argv)
    engine = verispec.load(args.model, threads=args.threads, spec=SpecOptions(enabled=False))
    prompts = (quoting_prompts if args.prompts == "quoting" else session_prompts)(args.clients)
    on_spec = SpecOptions(spec_type=args.spec_type)
    with serving(create_app(engine, model_name="served")) as url:
        solo = [wave(url, [p], args.new)[0][0] for p in prompts]  # each alone, plain
        engine.update_speculation(on_spec)
        wave(url, prompts[:2], 8)  # warm-up (and the cost model's profile)
        rates = {"off": [], "on": []}
        identical = True
        for _ in range(args.rounds):
            for label, spec in (("off", SpecOptions(enabled=False)), ("on", on_spec)):
                engine.update_speculation(spec)  # a fresh speculator
                engine.reset_cache()
                tokens = seconds = 0.0
                for _ in range(args.waves):
                    texts, n, s = wave(url, prompts, args.new)
                    identical &= texts == solo
                    tokens, seconds = tokens + n, seconds + s
                rates[label].append(tokens / seconds)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.model}: {args.clients} openai clients x {args.new} tokens x {args.waves} wave(s), {args.prompts} "
          f"prompts: off {off:.1f} tok/s, on ({engine.speculator.name if engine.speculator else '-'}) {on:.1f} tok/s "
          f"= {on / off:.2f}x (median of {args.rounds} interleaved rounds); every response identical to "
          f"its solo plain response: {identical}")


if __name__ == "__main__":
    main()
