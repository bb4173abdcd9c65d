"""llama.cpp's own `llama-bench`, built once into the verispec cache, run on the same GGUF.

    python benchmarks/llama_cpp.py --build            # ~10-20 min on 2 cores, once
    python benchmarks/llama_cpp.py --model gemma3-270m

The build takes llama.cpp's sources from the `llama-cpp-python` sdist on the package index
(pinned: LLAMA_CPP_PYTHON), configures its CMake project with GGML_NATIVE (this CPU's own
instruction set, as a user building llama.cpp here would) and builds only the `llama-bench`
target into `<verispec cache>/llama.cpp/<version>/`. Nothing is installed in the venv.

`llama_bench(path, threads)` returns llama-bench's tg128 decode (its default configuration,
weight repacking on) and pp512 prefill tok/s. Prefill is also measured with `--repack 0`:
on a Xeon with AMX the repacked path died with SIGILL in prefill (issue 10).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"


def build_dir() -> Path:
    from verispec.checkpoints import cache_dir

    return cache_dir("llama.cpp") / LLAMA_CPP_PYTHON


def bench_binary() -> Path | None:
    """The built llama-bench, or None when `--build` has not run."""
    binary = build_dir() / "build" / "bin" / "llama-bench"
    return binary if binary.is_file() else None


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
    subprocess.run(["cmake", "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-bench", "-j", str(jobs)], check=True)
    binary = bench_binary()
    if binary is None:
        raise RuntimeError(f"the build finished but {out}/bin/llama-bench is missing")
    return binary


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="download and build llama-bench (once)")
    parser.add_argument("--model", default=None, help="alias or GGUF path (default: the embedded default)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.build:
        print(build(jobs=os.cpu_count() or 2))
        return
    from verispec.api import resolve_model_path
    from verispec.registry import Registry

    print(json.dumps(llama_bench(resolve_model_path(args.model, Registry.discover()), args.threads)))


if __name__ == "__main__":
    main()
