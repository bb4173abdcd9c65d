"""`verispec serve` with N concurrent clients (the real `openai` package) on quoting prompts,
speculation off vs on: every response is checked equal to its solo plain response, and the
aggregate throughput (completion tokens / wall time of the whole wave) is reported per mode.

    python benchmarks/serve_clients.py [--model smollm2-135m-instruct] [--clients 8] [--new 96]
                                       [--rounds 3]

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
    args = parser.parse_args(argv)
    engine = verispec.load(args.model, threads=args.threads, spec=SpecOptions(enabled=False))
    prompts = quoting_prompts(args.clients)
    with serving(create_app(engine, model_name="served")) as url:
        solo = [wave(url, [p], args.new)[0][0] for p in prompts]  # each alone, plain
        engine.update_speculation(SpecOptions(spec_type="auto"))
        wave(url, prompts[:2], 8)  # warm-up (and the cost model's profile)
        rates = {"off": [], "on": []}
        identical = True
        for _ in range(args.rounds):
            for label, spec in (("off", SpecOptions(enabled=False)), ("on", SpecOptions(spec_type="auto"))):
                engine.update_speculation(spec)
                engine.reset_cache()
                texts, tokens, seconds = wave(url, prompts, args.new)
                identical &= texts == solo
                rates[label].append(tokens / seconds)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.model}: {args.clients} openai clients x {args.new} tokens, quoting prompts: "
          f"off {off:.1f} tok/s, on ({engine.speculator.name if engine.speculator else '-'}) {on:.1f} tok/s "
          f"= {on / off:.2f}x (median of {args.rounds} interleaved rounds); every response identical to "
          f"its solo plain response: {identical}")


if __name__ == "__main__":
    main()
