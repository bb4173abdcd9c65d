"""The C kernel build every distribution uses: `CLibrary`, a named library from the
distribution's own sources, compiled once per machine and loaded through ctypes.

Build: `$CC FLAGS sources -o <cache_dir("kernels")>/<name>-<key>.so -lm`, key = sha256 of the
sources and headers, the flags and the CPU's feature flags (a library built for another CPU or
from other sources is never loaded), with its sha256 beside it (`cache_digest`): a file that does not
match (damaged, replaced) is rebuilt, never loaded (a cut-short library can crash the process
inside dlopen). A failed build, or `VERISPEC_C_KERNELS=0`, makes `load()` None with one logged
warning naming the library and what runs instead; the caller takes its PyTorch path.

A plugin ships its .c files as package data and declares its library at import time:

    LIBRARY = CLibrary("toy", [Path(__file__).with_name("toy_conv.c")], declare=_signatures,
                       fallback="the toy's short convolution runs on its PyTorch path")
    lib = LIBRARY.load()   # ctypes.CDLL or None
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from verispec import cache_digest

#: every library's flags: -ffp-contract=off keeps each fp32 operation rounded as written (the
#: PyTorch statements of the kernels rely on it); OpenMP shares torch's thread team.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread", "-fopenmp")

log = logging.getLogger(__name__)


def cpu_flags() -> str:
    """This CPU's feature line from /proc/cpuinfo (the machine name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


class CLibrary:
    """One distribution's C library.

    name: the file's stem in the cache (letters, digits, `_`); sources/headers: the .c files
    compiled together and the headers they include (both part of the key); declare: sets the
    ctypes `argtypes`/`restype` of the library's functions once it is loaded; fallback: what
    runs without it, for the warning ("the X runs on its PyTorch path")."""

    def __init__(self, name: str, sources: Sequence[Path], headers: Sequence[Path] = (), *,
                 declare: Callable[[ctypes.CDLL], None] = lambda lib: None, fallback: str = "") -> None:
        self.name, self.sources, self.headers = name, tuple(sources), tuple(headers)
        self.declare, self.fallback = declare, fallback
        self._loaded: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable

    def path(self, extra_flags: Sequence[str] = ()) -> Path:
        """Where this machine's build (with `extra_flags`) lives; it may not exist yet."""
        from verispec.checkpoints import cache_dir

        texts = [src.read_text() for src in (*self.sources, *self.headers)]
        key = hashlib.sha256("\0".join([*texts, *FLAGS, *extra_flags, cpu_flags()]).encode()).hexdigest()[:16]
        return cache_dir("kernels") / f"{self.name}-{key}.so"

    def build(self, extra_flags: Sequence[str] = ()) -> Path:
        """Compile for this machine unless an intact build is there; returns the library's
        path. The compiler is $CC (a command line, e.g. "ccache gcc"), else cc, else gcc.
        extra_flags: more compiler flags (tests build other instruction sets with them). A
        compile states its time once (logged, and on a terminal's stderr). Raises RuntimeError
        naming the compiler's complaint (or its absence)."""
        path = self.path(extra_flags)
        if cache_digest.intact(path, f"{self.name} C library"):  # a damaged file can crash the process in dlopen
            return path
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
        if not compiler[0] or not shutil.which(compiler[0]):
            where = f"$CC={os.environ['CC']!r} is not a program" if os.environ.get("CC") else "no C compiler (cc/gcc) on PATH"
            raise RuntimeError(f"{where}: install one (Debian: apt-get install gcc) or point $CC at one")
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()

        def compile_into(partial: Path) -> None:
            result = subprocess.run([*compiler, *FLAGS, *extra_flags, *map(str, self.sources), "-o", str(partial),
                                     "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                complaint = result.stderr.strip()[-2000:] or f"exit status {result.returncode}, no message"
                raise RuntimeError(f"{' '.join(compiler)} failed on {' + '.join(s.name for s in self.sources)}: "
                                   f"{complaint}")

        if not cache_digest.save(path, compile_into):  # a cache it cannot write (one warning): a copy for this run
            from verispec.checkpoints import uncached_dir

            path = uncached_dir("kernels") / path.name
            cache_digest.save(path, compile_into)
        said = f"verispec: compiled the {self.name} kernels for this CPU in {time.perf_counter() - started:.1f} s (once: {path})"
        log.info(said)
        if sys.stderr.isatty():  # a person waiting on the first run sees why, once
            print(said, file=sys.stderr)
        return path

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, built on first use and declared; None when switched off
        (`VERISPEC_C_KERNELS=0`) or when it cannot be built or loaded (one warning says why).
        Decided once per process."""
        if self._loaded is False:
            self._loaded = None
            if os.environ.get("VERISPEC_C_KERNELS", "1") != "0":
                try:
                    lib = ctypes.CDLL(str(self.build()))
                    self.declare(lib)
                except (RuntimeError, OSError, AttributeError) as e:
                    log.warning("verispec: the %s kernels are unavailable (%s); %s", self.name, e,
                                self.fallback or "their PyTorch path runs instead")
                else:
                    self._loaded = lib
        return self._loaded

    def reset(self) -> None:
        """Forget the load decision: the next `load()` decides again (tests switch it)."""
        self._loaded = False
