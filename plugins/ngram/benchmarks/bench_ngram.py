"""Micro-benchmark (not a test): NGramSpeculator propose + 1-token commit, µs per token, by history length.

For each length it makes one sequence's state (`new_state()`) and commits a seeded
random-ish history into it (prompt-sized chunks of 4096 ids, a vocabulary of 32k with
copied spans so matches happen), then times a decode-like loop: propose for the pending
token, commit that one token. Prints µs/token, the best of 10
timed runs (the machine is shared), and the mean draft length.

    python plugins/ngram/benchmarks/bench_ngram.py [--lengths 1000 10000 100000 1000000] [--steps 5000]
"""
from __future__ import annotations

import argparse
import random
import time

from verispec.seams import DraftContext
from verispec_ngram.speculator import NGramSpeculator

VOCAB = 32_000


def random_ish(n: int, rng: random.Random, seq: list[int]) -> list[int]:
    """Extend seq by n ids: fresh random runs interleaved with copies of earlier spans."""
    out = seq
    trunk = len(seq) + n
    while len(out) < trunk:
        if len(out) > 64 and rng.random() < 0.5:
            start = rng.randrange(len(out) - 32)
            out.extend(out[start:start + rng.randint(4, 32)])
        else:
            out.extend(rng.randrange(VOCAB) for _ in range(rng.randint(4, 32)))
    del out[trunk:]
    return out


def bench(length: int, steps: int, repeats: int = 10) -> tuple[float, float]:
    rng = random.Random(length)
    history = random_ish(length + repeats * steps + 1, rng, [])
    speculator = NGramSpeculator(max_draft_tokens=8)
    state = speculator.new_state()  # one sequence's history and index
    for start in range(0, length, 4096):
        speculator.commit(state, history[start:min(start + 4096, length)], None, start)
    best, num_drafted, pos = float("inf"), 0, length
    for _ in range(repeats):
        contexts = [DraftContext(last_token=history[p], pos=p, max_draft_tokens=8, min_draft_prob=0.0)
                    for p in range(pos, pos + steps)]
        num_drafted = 0
        t0 = time.perf_counter()
        for c in contexts:
            num_drafted += len(speculator.propose(state, c))
            speculator.commit(state, (c.last_token,), None, c.pos)
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
        pos += steps
    return best, num_drafted / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=5_000)
    args = parser.parse_args()
    print(f"{'history':>10}  {'us/token':>9}  {'drafted/step':>12}")
    for length in args.lengths:
        us, drafted = bench(length, args.steps)
        print(f"{length:>10}  {us:>9.2f}  {drafted:>12.2f}")


if __name__ == "__main__":
    main()
