"""Plain decode and prefill, verispec vs llama.cpp's own `llama-bench`, on the same GGUF files.

    python benchmarks/llama_cpp.py --build         # once: ~10-20 min on 2 cores
    python benchmarks/llama_cpp.py                 # the three checkpoints, 2 threads
    python benchmarks/llama_cpp.py --models gemma3-270m --dtype int8

The build takes llama.cpp's sources from the `llama-cpp-python` sdist on the package index
(pinned: LLAMA_CPP_PYTHON), configures its CMake project with GGML_NATIVE (this CPU's own
instruction set, as a user building llama.cpp here would) and builds only `llama-bench` (plus
`llama-perplexity`, for the qwen35 cross-check test, and `llama-speculative` / `llama-simple`,
for the draft-model comparison) into
`<verispec cache>/llama.cpp/<version>/` (or `$VERISPEC_LLAMA_CPP/<version>/`). Nothing is
installed in the venv. On a terminal the configure and build steps show a progress bar (their
output goes to `build.log` beside the build, its tail printed if a step fails); elsewhere their
output passes through as it comes.

Per round and model, one row: llama-bench tg128 (its default configuration: weight repacking on)
and pp512 with and without repacking (`--repack 0`: on a Xeon with AMX the repacked path died with
SIGILL in prefill); ours measured the same way in this process: 128 greedy tokens after a
one-token prompt (decode tok/s excludes the first, as tg128 does), and the prefill of a 512-token
prompt of random ids (prompt tokens / time to the first token); then the ratios (prefill against
llama.cpp's better pp512). Rounds interleave the systems (--rounds, default 3); the summary gives
medians.
Run it on a quiet machine: two threads beside other work measure the contention, not the code.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"


def build_dir() -> Path:
    """`$VERISPEC_LLAMA_CPP/<version>`, else `<verispec cache>/llama.cpp/<version>`."""
    if os.environ.get("VERISPEC_LLAMA_CPP"):
        return Path(os.environ["VERISPEC_LLAMA_CPP"]) / LLAMA_CPP_PYTHON
    from verispec.checkpoints import cache_dir

    return cache_dir("llama.cpp") / LLAMA_CPP_PYTHON


def built(name: str = "llama-bench") -> Path | None:
    """The built binary `name` (llama-bench, llama-perplexity, ...), or None when `--build` has not run."""
    binary = build_dir() / "build" / "bin" / name
    return binary if binary.is_file() else None


def bench_binary() -> Path | None:
    """The built llama-bench, or None when `--build` has not run."""
    return built("llama-bench")


def build(jobs: int = 2) -> Path:
    """Download the pinned sdist, configure and build `llama-bench`; returns its path."""
    root = build_dir()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], check=True)
    source = root / "src"
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(root / "unpacked", filter="data")
        (root / "unpacked" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp").rename(source)
    out = root / "build"
    log = root / "build.log"
    run_with_progress(["cmake", "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                       "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
                       "-DLLAMA_BUILD_SERVER=OFF"], "configuring llama.cpp", log)
    # llama-perplexity: models/qwen35/tests/test_llama_cpp_crosscheck.py; llama-speculative and
    # llama-simple, llama-speculative-simple (--spec-type draft-dflash):
    # benchmarks/speculation_vs_llama_cpp.py
    run_with_progress(["cmake", "--build", str(out), "--target", "llama-bench", "llama-perplexity",
                       "llama-speculative", "llama-simple", "llama-speculative-simple", "-j", str(jobs)],
                      "building llama.cpp", log)
    binary = bench_binary()
    if binary is None:
        raise RuntimeError(f"the build finished but {out}/bin/llama-bench is missing")
    return binary


def build_percent(line: str) -> float | None:
    """Percent done that a build tool's output line reports: make's `[ 42%] ...` or ninja's
    `[12/345] ...`; None for any other line."""
    if m := re.match(r"\[\s*(\d+)%\]", line):
        return float(m[1])
    if (m := re.match(r"\[(\d+)/(\d+)\]", line)) and int(m[2]):
        return 100.0 * int(m[1]) / int(m[2])
    return None


def run_with_progress(command: list[str], desc: str, log: Path) -> None:
    """Run `command`; raises CalledProcessError when it fails. On a terminal (stderr) its output is
    appended to `log` and a bar follows `build_percent`; otherwise the output passes through."""
    if not sys.stderr.isatty():
        subprocess.run(command, check=True)
        return
    from tqdm import tqdm

    with open(log, "a") as out, tqdm(total=100, desc=desc, unit="%", leave=False,
                                     bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") as bar:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            out.write(line)
            done = build_percent(line)
            if done is not None and done > bar.n:
                bar.update(done - bar.n)
        if process.wait():
            bar.close()
            print(*log.read_text().splitlines()[-30:], sep="\n", file=sys.stderr)
            raise subprocess.CalledProcessError(process.returncode, command)


def _run(binary: Path, path: str, threads: int, *args: str) -> list[dict]:
    done = subprocess.run([str(binary), "-m", path, "-t", str(threads), "-o", "json", *args],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def llama_bench(path: str, threads: int = 2, repetitions: int = 3) -> dict[str, float]:
    """llama-bench tok/s on `path`: tg128 (default config), pp512 with and without repacking.

    Raises FileNotFoundError when llama-bench is not built (run this script with --build).
    """
    binary = bench_binary()
    if binary is None:
        raise FileNotFoundError("llama-bench is not built: run `python benchmarks/llama_cpp.py --build` once")
    reps = ["-r", str(repetitions)]
    tg = _run(binary, path, threads, "-p", "0", "-n", "128", *reps)[0]["avg_ts"]
    figures = {"llama_cpp_tg128": tg}
    for repack in ("1", "0"):
        try:
            pp = _run(binary, path, threads, "-p", "512", "-n", "0", "--repack", repack, *reps)[0]["avg_ts"]
        except subprocess.CalledProcessError as error:  # the AMX repack path has crashed on some CPUs
            pp = float("nan")
            print(f"llama-bench pp512 --repack {repack} failed (exit {error.returncode})", file=sys.stderr)
        figures[f"llama_cpp_pp512_repack{repack}"] = pp
    return figures


def _generate(engine, ids: list[int], max_tokens: int):
    """One request from an empty cache, run to the end; its GenerationResult."""
    engine.reset_cache()
    generation = engine.generate(ids, max_tokens=max_tokens, ignore_eos=True)
    for _ in generation:  # iterating steps the engine
        pass
    return generation.result


def load_ours(model: str, threads: int, dtype: str | None):
    """verispec's plain engine on `model`, warmed up."""
    import verispec

    engine = verispec.load(model, dtype=dtype, threads=threads, enabled=False)
    bos = engine.encode("")[:1] or [1]
    _generate(engine, bos + [100] * 8, 8)
    return engine


def ours(engine) -> dict[str, float]:
    """verispec's plain decode (tg128-like) and prefill (pp512-like) tok/s, best of two."""
    import torch

    bos = engine.encode("")[:1] or [1]
    decode = max(_generate(engine, bos, 128).decode_tokens_per_s for _ in range(2))
    ids = torch.randint(100, engine.trunk.vocab_size - 100, (512,), generator=torch.Generator().manual_seed(0))
    prefill = max(_generate(engine, ids.tolist(), 1).prefill_tokens_per_s for _ in range(2))
    return {"verispec_tg128": decode, "verispec_pp512": prefill}


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="VERISPEC_LLAMA_CPP=DIR: a llama.cpp build made elsewhere (DIR/bin/"
                                            "llama-bench)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--build", action="store_true", help="download and build llama-bench (once)")
    parser.add_argument("--models", nargs="+", help="checkpoint aliases or GGUF paths",
                        default=["gemma3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                 "qwen2.5-coder-1.5b-instruct"])
    parser.add_argument("--dtype", default=None, help="our weight dtype (default: the model's choice)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both tools")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the summary gives medians")
    args = parser.parse_args()
    if args.build:
        print(build(jobs=os.cpu_count() or 2))
        return
    from verispec.api import resolve_model_path
    from verispec.errors import VerispecError
    from verispec.registry import Registry

    from verispec.cpu import default_threads

    idle = default_threads()
    if idle is not None and idle < args.threads:  # two threads beside other work stall each other
        print(f"warning: only {idle} of the cores are idle and the run uses {args.threads} threads: the "
              "timings (both tools') will be far below this machine's; rerun on a quiet host", file=sys.stderr)
    registry = Registry.discover()
    engines = {}
    for model in args.models:
        try:
            path = resolve_model_path(model, registry)
        except VerispecError as error:  # a checkpoint package not installed: say so, go on
            print(json.dumps({"model": model, "skipped": str(error)}))
            continue
        engines[model] = (path, load_ours(path, args.threads, args.dtype))
    rows: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for model, (path, engine) in engines.items():
            row = {**ours(engine), **llama_bench(path, args.threads, repetitions=1)}
            row["decode_ratio"] = row["verispec_tg128"] / row["llama_cpp_tg128"]
            row["prefill_ratio"] = row["verispec_pp512"] / max(row["llama_cpp_pp512_repack0"],
                                                               row["llama_cpp_pp512_repack1"])
            rows.setdefault(model, []).append(row)
            print(json.dumps({"round": round_, "model": model,  # a llama-bench run that failed: null
                              **{k: None if math.isnan(v) else round(v, 2) for k, v in row.items()}}), flush=True)
    print("\nmedians over rounds: model | ours tg128 | llama.cpp tg128 | decode ratio | ours pp512 | "
          "llama.cpp best pp512 | prefill ratio (ratios: medians of the per-round ratios)")
    for model, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        best_pp = statistics.median(max(r["llama_cpp_pp512_repack0"], r["llama_cpp_pp512_repack1"]) for r in runs)
        print(f"{model} | {med['verispec_tg128']:.2f} | {med['llama_cpp_tg128']:.2f} | {med['decode_ratio']:.2f} | "
              f"{med['verispec_pp512']:.1f} | {best_pp:.1f} | {med['prefill_ratio']:.2f}")


if __name__ == "__main__":
    main()
