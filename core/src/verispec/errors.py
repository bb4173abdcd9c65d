"""The marker for verispec's own errors: bad input, reported in one line that names the fix.

Every error class verispec raises on purpose for something the user (or a plugin author)
can fix — a foreign file, an unknown model, a prompt longer than the context, a sampling
value out of range — derives from `VerispecError`, beside the builtin base it always had
(ValueError, LookupError, ...), so existing `except ValueError` clauses keep working.

The CLI prints a VerispecError as `verispec: error: <message>` (exit 1) and the server
answers it with HTTP 400; any other exception is a bug (in verispec or a plugin): the CLI
shows its traceback, the server answers 500.
"""
from __future__ import annotations

import shlex
import sys

__all__ = ["DamagedFile", "InvalidArgument", "UnsupportedArchitecture", "UnsupportedVariant", "UnusedTensors",
           "VerispecError", "larger_context_advice", "pip_install"]


def pip_install(args: str) -> str:
    """The command that installs `args` into this interpreter's environment (a bare `pip`
    may be another Python's, e.g. outside the venv verispec runs in)."""
    return f"{shlex.quote(sys.executable)} -m pip install {args}"


def larger_context_advice(max_context_length: int, trained_context_length: int | None) -> str:
    """The clause that ends every "does not fit in the context" message (CLI, engine, server):
    `, or load the model with a larger --context-length[, up to T]`, or, when the context already
    is the whole trained length T, a note saying so (a larger one would be refused at load)."""
    if trained_context_length is not None and trained_context_length <= max_context_length:
        return " (the context already is the model's whole trained length)"
    upto = f", up to {trained_context_length}" if trained_context_length else ""
    return f", or load the model with a larger --context-length{upto}"


class VerispecError(Exception):
    """Bad input, reported in one line; the message says how to fix it."""


class InvalidArgument(VerispecError, ValueError):
    """A value passed to verispec that it refuses (max_tokens < 1, an empty prompt, a
    sampling value out of range, an unknown scenario)."""


class UnsupportedVariant(VerispecError, ValueError):
    """A file of a family a model package loads, in a variant whose math or layout it does not
    implement. Message: `<source>: <what>; <fix>`. Each family subclasses it with its own name."""

    def __init__(self, source: str, what: str, fix: str):
        self.source, self.what = source, what
        super().__init__(f"{source}: {what}; {fix}")


class UnusedTensors(UnsupportedVariant):
    """A file of a family a model package loads that holds tensors its math would not read
    (another variant: MoE, extra norms, sidecars). The message lists the first of them."""

    def __init__(self, source: str, family: str, names: list[str]):
        self.names = names
        super().__init__(source, f"tensors the {family} math does not use: {names[:6]}",
                         "the file is another variant and cannot be served by this package")


class UnsupportedArchitecture(VerispecError, ValueError):
    """A GGUF whose `general.architecture` the package it was handed to does not load."""

    def __init__(self, source: str, architecture: str, loads: tuple[str, ...]):
        self.source, self.architecture = source, architecture
        super().__init__(f"{source} is a {architecture!r} GGUF; this package loads {', '.join(map(repr, loads))} "
                         "files (pick the model package for its architecture)")


class DamagedFile(VerispecError, ValueError):
    """A model file whose numbers contradict each other or its tensors (a block count the tensors
    do not have, zero heads, a token list the embedding does not match, non-finite weights).
    Message: `<source>: <what>; <fix>` (fix: by default, convert the file again)."""

    def __init__(self, source: str, what: str,
                 fix: str = "the file is damaged or was converted wrongly: convert it again"):
        self.source, self.what = source, what
        super().__init__(f"{source}: {what}; {fix}")
