"""`verispec` command line: argument wiring only (torch is imported lazily, per command).

Exit status: 0 done; 1 bad input (one line naming the fix: verispec's own error classes,
and a path given that cannot be opened); 2 bad flags (the error and a one-line usage);
70 an internal error, a bug (its traceback, then one line asking for a report); 130
interrupted (Ctrl-C: one line). Output cut short by its reader (`verispec plugins | head`)
ends quietly with 0. Text arguments (the prompt, --stop) must be UTF-8: a byte that is not
is an error naming the byte and its offset; paths (--model) go to the OS as given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

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

#: the built-in prompt (`verispec generate` with none): quoting a document, where drafting pays;
#: it stops at DEFAULT_STOP and is compared with plain decoding in the same run.
DEFAULT_PROMPT = """Sonnet 18, by William Shakespeare (the first twelve lines):

<poem>
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
</poem>

The same lines, copied out again:

<poem>
"""
DEFAULT_STOP = "</poem>"

EXIT_USER_ERROR, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 70, 130

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


def _check_text_args(args) -> None:
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
                   help="weight dtype (default: the model's choice; gguf: the file's own quantised blocks, see README)")
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

    bench = sub.add_parser("bench", help="plain vs speculative decoding on named scenarios")
    bench.add_argument("--scenario", action="append", help="scenario name (repeatable; default: all)")
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
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $VERISPEC_API_KEY; none: open)")
    _add_model_args(serve)
    _add_spec_args(serve)
    for command in sub.choices.values():
        command.epilog = EPILOG
    return parser


def _check_removed_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REMOVED_FLAGS:
            raise CliError(f"{flag} was removed; use {REMOVED_FLAGS[flag]} instead")
        if flag in LLAMA_CPP_FLAGS:
            raise CliError(f"{flag} is llama.cpp's spelling; verispec's is {LLAMA_CPP_FLAGS[flag]}")


def spec_options(args):
    from verispec.engine import SpecOptions

    return SpecOptions(enabled=args.spec, spec_type=args.spec_type, max_draft_tokens=args.spec_draft,
                       min_draft_prob=args.spec_pmin, draft_model=args.draft_model,
                       adaptive=args.spec_adaptive == "on")


def sampling_params(args):
    from verispec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, seed=args.seed)


def load_engine(args):
    from verispec.api import load
    from verispec.cpu import default_threads

    threads = args.threads or default_threads()  # idle cores now: one busy core halves a 2-thread decode
    tp = getattr(args, "tp", None)
    if tp and tp > 1 and not args.threads and threads:
        from verispec.tensor_parallel import local_ranks

        threads = max(1, threads // local_ranks(tp))  # this machine's idle cores shared among its own ranks
    return load(args.model, dtype=args.dtype, threads=threads, context_length=args.context_length,
                spec=spec_options(args), max_running=getattr(args, "max_running", None),
                kv_cache_gb=args.kv_cache_gb, device=getattr(args, "device", None),
                **({"tensor_parallel": tp} if tp and tp > 1 else {}))


def cmd_plugins(args) -> int:
    from verispec.registry import Registry, format_plugin_table

    rows = Registry.discover().plugin_rows()
    print(json.dumps(rows, indent=1) if args.json else format_plugin_table(rows))
    return 0


def cmd_generate(args) -> int:
    sampling = sampling_params(args)
    engine = load_engine(args)
    context = engine.trunk.max_context_length
    if args.max_tokens > context:  # as the server's 400: not hours of decoding into a full context
        from verispec.errors import InvalidArgument, larger_context_advice
        from verispec.seams import declared

        advice = larger_context_advice(context, declared(engine.trunk, "trained_context_length"))
        raise InvalidArgument(f"--max-tokens {args.max_tokens} is more than the {context}-token context can hold; "
                              f"lower it{advice}")
    builtin = args.prompt is None
    prompt = DEFAULT_PROMPT if builtin else _stdin_prompt() if args.prompt == "-" else args.prompt
    stop = args.stop or ([DEFAULT_STOP] if builtin else [])
    if (args.compare_plain or builtin) and sampling.seed is None and not sampling.is_greedy:
        import random

        import attrs

        # the plain rerun must draw the same numbers: unseeded, each run would draw its own
        sampling = attrs.evolve(sampling, seed=random.randrange(2 ** 31))
    run = dict(max_tokens=args.max_tokens, sampling=sampling, stop=stop, ignore_eos=args.ignore_eos, chat=args.chat)
    generation = engine.generate(prompt, **run)
    from verispec.streamed_text import warnings_on_their_own_line

    with warnings_on_their_own_line(sys.stdout, sys.stderr) as text:
        for event in generation:
            if not args.json:
                text.write(event.text)
    r = generation.result
    plain = None
    if args.compare_plain or builtin:
        plain = engine.generate(prompt, **run, speculate=False)
        for _ in plain:
            pass
        plain = plain.result
    finish = r.finish_reason
    if finish == "length" and len(r.tokens) < args.max_tokens:  # not --max-tokens: say what ended it
        finish += f" (context full at {r.prompt_tokens + len(r.tokens)} tokens; --context-length sets it)"
    speculator = f"{r.speculator} (switched off: it faulted)" if r.speculator_fault else r.speculator or "off"
    summary = (f"{len(r.tokens)} tokens, finish={finish}, ttft {r.ttft_ms:.0f} ms, "
               f"decode {r.decode_tokens_per_s:.1f} tok/s, speculator={speculator}, "
               f"drafted={r.spec.num_draft_tokens} accepted={r.spec.num_accepted_tokens}")
    if args.json:
        print(json.dumps({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                          "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens)},
                          "ttft_ms": r.ttft_ms, "decode_tokens_per_s": r.decode_tokens_per_s,
                          "speculator": r.speculator, "speculator_fault": r.speculator_fault,
                          "drafted": r.spec.num_draft_tokens,
                          "accepted": r.spec.num_accepted_tokens, "governor": r.governor,
                          "reason": r.reason.as_dict(),
                          **({"plain": {"decode_tokens_per_s": plain.decode_tokens_per_s,
                                        "identical": plain.tokens == r.tokens}} if plain else {})}))
    else:
        print(flush=True)  # the text ends with a newline, so a file or pipe gets a whole last line
        print(f"\n[{summary}]" + (f"\n[{r.governor}]" if r.governor else "")
              + f"\n[speculation: {r.reason.code}: {r.reason.text}]", file=sys.stderr)
        if plain is not None:
            print(comparison_line(r, plain), file=sys.stderr)
        from verispec.cpu import generation_hint

        hint = generation_hint(engine, r)
        if hint:
            print(hint, file=sys.stderr)
    return 0


def comparison_line(spec, plain) -> str:
    """`[same prompt, plain decoding: 30.2 tok/s; speculative 71.5 tok/s (2.37x); identical: yes]`
    from two GenerationResults of one run (a ratio measured side by side, never an absolute claim)."""
    ratio = f" ({spec.decode_tokens_per_s / plain.decode_tokens_per_s:.2f}x)" if plain.decode_tokens_per_s else ""
    same = "yes" if spec.tokens == plain.tokens else "NO (a bug: please report it)"
    return (f"[same prompt, plain decoding: {plain.decode_tokens_per_s:.1f} tok/s; speculative "
            f"{spec.decode_tokens_per_s:.1f} tok/s{ratio}; identical: {same}]")


def _stdin_prompt() -> str:
    """`generate -`: the prompt is standard input, UTF-8. Raises InvalidArgument naming the first
    byte that is not."""
    from verispec.errors import InvalidArgument
    from verispec.tokenizer import text_problem

    text = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
    problem = text_problem(text, os_bytes=True)
    if problem:
        raise InvalidArgument(f"the prompt on standard input is not UTF-8 text: {problem}")
    return text


def cmd_bench(args) -> int:
    from verispec.bench import load_scenarios, run_bench

    spec, scenarios = spec_options(args), load_scenarios(args.scenario)  # bad input fails before the model loads
    if args.diagnostic:
        if args.plot:
            raise CliError("--plot draws the timed bench; leave it out with --diagnostic")
        from verispec import bench_diagnostic

        return bench_diagnostic.run(load_engine(args), scenarios, max_tokens=args.max_tokens, as_json=args.json)
    if args.plot:
        from verispec.bench_plot import require_matplotlib

        require_matplotlib()
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):  # found out now, not after the whole bench
            raise CliError(f"--plot {args.plot}: there is no folder {folder}")
    return run_bench(load_engine(args), spec, scenarios, max_tokens=args.max_tokens, repeats=args.repeats,
                     as_json=args.json, plot=args.plot)


def cmd_chat(args) -> int:
    from verispec.chat import run_chat

    sampling = sampling_params(args)
    engine = load_engine(args)
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is reported by run_chat, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    return run_chat(engine, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop,
                    ignore_eos=args.ignore_eos)


def cmd_serve(args) -> int:
    try:
        from verispec.server import serve
    except ImportError as e:
        from verispec.errors import pip_install

        deps = pip_install("'fastapi>=0.110' 'uvicorn>=0.29'")
        raise CliError(f"verispec serve needs FastAPI and uvicorn ({e}): {deps} (the serve extra of core/; "
                       "./scripts/setup.sh installs it)") from None

    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key is empty: give a key, or leave the flag out to serve without one")
    engine = load_engine(args)
    serve(engine, host=args.host, port=args.port, model_name=args.model or "default",
          request_timeout=args.request_timeout, api_key=args.api_key)
    return 0


def cmd_cache(args) -> int:
    from verispec import checkpoints

    if args.clear:
        checkpoints.clear_cache()
        print(f"cleared {checkpoints.cache_dir()}")
    for entry in checkpoints.list_cache():
        print(entry)
    return 0


COMMANDS = {"generate": cmd_generate, "plugins": cmd_plugins, "bench": cmd_bench, "cache": cmd_cache,
            "chat": cmd_chat, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _check_removed_flags(argv)
        args = build_parser().parse_args(argv)
        _check_text_args(args)
        rc = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that left shows up here, not at interpreter exit
        return rc
    except CliError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `verispec plugins | head`: the reader has what it wanted
        _stdout_to_devnull()
        return 0
    except Exception as e:  # noqa: BLE001 -- user errors print one line; anything else is a bug
        if os.environ.get("VERISPEC_DEBUG") == "1":
            raise
        if _is_user_error(e):
            print(f"verispec: error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        traceback.print_exc()
        print("verispec: internal error (a bug in verispec or a plugin, not in your input); please report "
              "it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL


#: OS errors about a path the user gave (--model, a cache directory): one line is enough.
USER_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _is_user_error(error: BaseException) -> bool:
    """Bad input (a foreign GGUF, an unknown model, a speculator that cannot serve, a prompt
    too long...): verispec's own error classes (verispec.errors.VerispecError) carry the fix in
    their message, so one line is enough; so do the OS errors of USER_OS_ERRORS. Anything else
    (an IndexError, a KeyError, a bare ValueError) is a bug and shows its traceback.
    Set VERISPEC_DEBUG=1 to see the traceback anyway."""
    from verispec.errors import VerispecError

    return isinstance(error, (VerispecError, *USER_OS_ERRORS))


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
