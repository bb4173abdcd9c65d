"""The `verispec` command line's flags: the parser (`build_parser`), the flag spellings it
refuses with their replacement, and the checks of text arguments (cli/main.py's module docstring
states the exit statuses these lead to).
"""
from __future__ import annotations

import argparse
import os

EXIT_USAGE = 2

#: removed spellings → their replacement; using one is an error, never a silent ignore.
REMOVED_FLAGS = {
    "--mtp-spec": "--spec",
    "--mtp-draft": "--spec-draft",
    "--mtp-pmin": "--spec-pmin",
    "--mtp-draft-model": "--draft-model",
    "--spec-draft-model": "--draft-model",
}
#: llama.cpp's speculative-decoding flags → verispec's; argparse would call them unrecognized,
#: or read `--draft 8` as an abbreviation of --draft-model. (llama.cpp's --draft-min has none:
#: verispec's drafters draft as many tokens as pay, up to --spec-draft.)
LLAMA_CPP_FLAGS = {
    "--draft-max": "--spec-draft",
    "--draft": "--spec-draft",
    "--draft-n": "--spec-draft",
    "--draft-p-min": "--spec-pmin",
    "--model-draft": "--draft-model",
    "-md": "--draft-model",
}

EPILOG = ("exit status: 0 done, 1 bad input (one line naming the fix), 2 bad flags, 70 internal error "
          "(a bug: traceback), 130 interrupted. Text arguments (prompt, --stop) must be UTF-8; a byte "
          "that is not is an error naming it. VERISPEC_DEBUG=1 shows tracebacks for every error.")


class CliError(Exception):
    """A usage problem: printed as `verispec: error: ...`, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """A bad flag prints the one error and a one-line usage, not the whole usage block."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n"
                              f"usage: {self._short_usage()}  (--help lists the flags)\n")

    def _short_usage(self) -> str:
        parts = [self.prog]
        if any(a.option_strings and a.dest != "help" for a in self._actions):
            parts.append("[flags]")
        for a in self._actions:
            if a.option_strings:
                continue
            name = a.metavar or ("{" + ",".join(a.choices) + "} ..." if a.choices else a.dest)
            parts.append(f"[{name}]" if a.nargs in ("?", "*") else name)
        return " ".join(parts)


def check_text_args(args) -> None:
    """The text arguments (the prompt, --stop) are UTF-8 (see the module docstring): raises
    InvalidArgument naming the first byte that is not, a bad input (exit 1) as on stdin."""
    from verispec.errors import InvalidArgument
    from verispec.tokenizer import text_problem

    for name, texts in [("the prompt", [getattr(args, "prompt", None)]), ("--stop", getattr(args, "stop", None))]:
        for text in texts or []:
            problem = text_problem(text, os_bytes=True) if text is not None else None
            if problem:
                raise InvalidArgument(f"{name} is not UTF-8 text: {problem}; verispec reads text arguments as "
                                      "UTF-8 (set the terminal's encoding to UTF-8, e.g. LANG=C.UTF-8)")


def _stop_string(text):
    if not text:
        raise argparse.ArgumentTypeError("stop strings must be non-empty; leave the empty one out")
    return text


def _ranged(kind, lo, hi):
    """An argparse type: `kind` within [lo, hi] (argparse's message names the flag)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value}: choose {lo}..{hi}")
        return value
    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF path or checkpoint alias (default: the embedded default model)")
    p.add_argument("--dtype", choices=["gguf", "int8", "int4", "bf16", "fp32"],
                   help="weight dtype (default: the model's choice; gguf: the file's own quantised blocks, see docs/kernels.md)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="where the trunk runs (default cpu; auto: cuda when torch sees a GPU)")
    p.add_argument("--threads", type=_ranged(int, 1, 1024),
                   help="torch threads (default: the cores idle at start-up, sampled for 0.2 s)")
    p.add_argument("--context-length", type=_ranged(int, 16, 1 << 20))
    p.add_argument("--kv-cache-gb", type=_ranged(float, 0.0, 1e6), default=None, metavar="GiB",
                   help="KV/state memory for running and prefix-cached sequences; a request that does not "
                        "fit waits (default: half of the memory available once the model is loaded; 0: no limit)")
    p.add_argument("--tp", type=_ranged(int, 1, 1024), default=None, metavar="N",
                   help="tensor parallelism over N ranks: spawns N-1 local processes (threads per rank), or, with "
                        "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torchrun-style), joins as that rank")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--spec", dest="spec", action="store_true", default=True, help="speculate when it pays (default)")
    g.add_argument("--no-spec", dest="spec", action="store_false", help="plain decoding")
    g.add_argument("--spec-type", default="auto", help="auto | draft-head | block | ngram | draft-model | <registered name>")
    g.add_argument("--spec-draft", type=_ranged(int, 1, 64), help="most drafts per step, K (default 8)")
    g.add_argument("--spec-pmin", type=_ranged(float, 0.0, 1.0), help="draft gate (per algorithm)")
    g.add_argument("--draft-model", metavar="PATH|ALIAS",
                   help="drafter GGUF or checkpoint alias; its general.architecture decides what it is: a "
                        "drafter file, or a smaller model of the same tokenizer (--spec-type draft-model)")
    g.add_argument("--spec-adaptive", choices=["on", "off"], default="on", help="off forces drafting")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_ranged(int, 1, 1 << 20), default=128)
    g.add_argument("--temperature", type=_ranged(float, 0.0, 100.0), default=0.0)
    g.add_argument("--top-k", type=_ranged(int, 0, 1 << 24), default=0)
    g.add_argument("--top-p", type=_ranged(float, 1e-9, 1.0), default=1.0)
    g.add_argument("--min-p", type=_ranged(float, 0.0, 1.0), default=0.0)
    g.add_argument("--repetition-penalty", type=_ranged(float, 1e-3, 100.0), default=1.0)
    g.add_argument("--frequency-penalty", type=_ranged(float, -2.0, 2.0), default=0.0)
    g.add_argument("--presence-penalty", type=_ranged(float, -2.0, 2.0), default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], type=_stop_string,
                   help="stop string, non-empty (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Speculative decoding, exactly.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?",
                     help="UTF-8 text, or - to read it from standard input (a prompt past the OS's "
                          "argument limit, ~128 KiB) (default: a built-in one, copying out a poem, "
                          "stopping at its end and compared with plain decoding)")
    gen.add_argument("--compare-plain", action="store_true",
                     help="then decode the prompt plainly too and print one line: tok/s both ways and whether "
                          "the tokens are identical (on for the built-in prompt)")
    gen.add_argument("--chat", action="store_true", help="render the prompt through the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and stats")
    _add_model_args(gen)
    _add_spec_args(gen)
    _add_sampling_args(gen)

    plugins = sub.add_parser("plugins", help="list installed plugins (does not import torch)")
    plugins.add_argument("--json", action="store_true")
    plugins.add_argument("--check", action="store_true",
                         help="import every plugin's factories, loaders and decline checks (as building them would; "
                              "torch included) and report each that does not import, naming its distribution; exit 1 "
                              "if any does not, or a plugin was kept out")

    bench = sub.add_parser("bench", help="plain vs speculative decoding on named scenarios")
    bench.add_argument("--scenario", action="append",
                       help="scenario name, or FILE.json of your own (repeatable; default: all)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--compare", choices=["transformers"], help="also run a peer system side by side")
    _add_model_args(bench)
    _add_spec_args(bench)
    bench.add_argument("--max-tokens", type=_ranged(int, 1, 1 << 16),
                       help="new tokens per turn (default: each scenario's own)")
    bench.add_argument("--repeats", type=_ranged(int, 1, 100), default=1,
                       help="plain/spec pairs per scenario; speeds are medians")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="also draw tok/s per scenario and one scenario's per-step trace (needs matplotlib: "
                            "pip install 'matplotlib>=3.8')")
    bench.add_argument("--diagnostic", action="store_true",
                       help="instead of timing: teacher-forced speculative rows vs plain rows, max |logit error| "
                            "and argmax flips per row class (--max-tokens: tokens per scenario, default 64)")

    cache = sub.add_parser("cache", help="show or clear assembled checkpoints and converted weights")
    cache.add_argument("--clear", action="store_true")

    chat = sub.add_parser("chat", help="interactive chat on stdin (one line per turn; /reset; Ctrl-D exits)")
    _add_model_args(chat)
    _add_spec_args(chat)
    _add_sampling_args(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    serve.add_argument("--port", type=_ranged(int, 0, 65535), default=8000)
    serve.add_argument("--request-timeout", type=_ranged(float, 0.01, 1e7),
                       default=600.0, metavar="SECONDS",
                       help="a generation running longer ends there with finish_reason \"length\" "
                            "(default 600; time waiting for the engine does not count)")
    serve.add_argument("--max-running", type=_ranged(int, 1, 1024), default=16, metavar="N",
                       help="requests decoding together in one batch (default 16); later ones queue")
    serve.add_argument("--api-key", metavar="KEY", default=os.environ.get("VERISPEC_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $VERISPEC_API_KEY, which, unlike "
                            "this flag, other users do not see in ps; none: open)")
    serve.add_argument("--allowed-host", action="append", metavar="NAME", default=[],
                       help="a host name clients reach the server by, besides IP addresses and localhost (repeatable; "
                            "'*': any); a request naming another host in its Host header answers 421 (DNS rebinding)")
    serve.add_argument("--docs", action="store_true",
                       help="serve FastAPI's /docs, /redoc and /openapi.json (off: they load scripts from a CDN and "
                            "stay open under --api-key)")
    _add_model_args(serve)
    _add_spec_args(serve)
    for command in sub.choices.values():
        command.epilog = EPILOG
    return parser


def check_removed_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REMOVED_FLAGS:
            raise CliError(f"{flag} was removed; use {REMOVED_FLAGS[flag]} instead")
        if flag in LLAMA_CPP_FLAGS:
            raise CliError(f"{flag} is llama.cpp's spelling; verispec's is {LLAMA_CPP_FLAGS[flag]}")
