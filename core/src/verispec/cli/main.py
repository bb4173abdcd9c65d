"""`verispec` command line: the commands (torch is imported lazily, per command); the flags
are cli/flags.py's.

Exit status: 0 done; 1 bad input (one line naming the fix: verispec's own error classes,
and a path given that cannot be opened); 2 bad flags (the error and a one-line usage);
70 an internal error, a bug (its traceback, then one line asking for a report); 130
interrupted (Ctrl-C: one line). Output cut short by its reader (`verispec plugins | head`)
ends quietly with 0. Text arguments (the prompt, --stop) must be UTF-8: a byte that is not
is an error naming the byte and its offset; paths (--model) go to the OS as given.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

from verispec.cli.flags import EXIT_USAGE, CliError, build_parser, check_removed_flags, check_text_args

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

EXIT_USER_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 70, 130

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
    from verispec.cli.plugin_listing import format_check, format_plugin_table
    from verispec.registry import Registry

    registry = Registry.discover()
    if args.check:
        rows = registry.check_references()
        print(json.dumps(rows, indent=1) if args.json else format_check(rows))
        return EXIT_USER_ERROR if any(row["error"] for row in rows) else 0
    rows = registry.plugin_rows()
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
                          "reason": r.reason.as_dict(), "declined": own_declines(engine.choice),
                          **({"plain": {"decode_tokens_per_s": plain.decode_tokens_per_s,
                                        "identical": plain.tokens == r.tokens}} if plain else {})}))
    else:
        print(flush=True)  # the text ends with a newline, so a file or pipe gets a whole last line
        print(f"\n[{summary}]" + (f"\n[{r.governor}]" if r.governor else "")
              + f"\n[speculation: {r.reason.code}: {r.reason.text}]", file=sys.stderr)
        declined = own_declines(engine.choice)
        if declined and r.speculator:
            print(f"[declined before {r.speculator}: " + "; ".join(f"{name}: {why}" for name, why in declined.items())
                  + "]", file=sys.stderr)
        if plain is not None:
            print(comparison_line(r, plain), file=sys.stderr)
        from verispec.cpu import generation_hint

        hint = generation_hint(engine, r)
        if hint:
            print(hint, file=sys.stderr)
    return 0


def own_declines(choice) -> dict[str, str]:
    """name -> reason of the speculators ranked above the one picked that declined in their own
    code (a `Decline`, a `DrafterMismatch`, their decline check, a failed build): a plugin author
    sees why theirs lost. Declines by declaration (no draft head...) and factories returning
    None stay quiet; with nothing picked the speculation line names every reason already."""
    if choice is None or choice.speculator is None:
        return {}
    return {name: why for name, why in choice.declines.items() if name in choice.own_reasons}


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
    from verispec.bench.run import load_scenarios, run_bench

    spec, scenarios = spec_options(args), load_scenarios(args.scenario)  # bad input fails before the model loads
    if args.diagnostic:
        if args.plot:
            raise CliError("--plot draws the timed bench; leave it out with --diagnostic")
        from verispec.bench import diagnostic

        return diagnostic.run(load_engine(args), scenarios, max_tokens=args.max_tokens, as_json=args.json)
    if args.plot:
        from verispec.bench.plot import require_matplotlib

        require_matplotlib()
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):  # found out now, not after the whole bench
            raise CliError(f"--plot {args.plot}: there is no folder {folder}")
    return run_bench(load_engine(args), spec, scenarios, max_tokens=args.max_tokens, repeats=args.repeats,
                     as_json=args.json, plot=args.plot)


def cmd_chat(args) -> int:
    from verispec.chat.repl import run_chat

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
    from verispec.server.connection import check_port

    check_port(args.host, args.port)  # a port in use is found now, not after the model has loaded
    engine = load_engine(args)
    serve(engine, host=args.host, port=args.port, model_name=args.model or "default",
          request_timeout=args.request_timeout, api_key=args.api_key, allowed_hosts=args.allowed_host,
          docs=args.docs)
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
    if os.environ.get("VERISPEC_DEBUG") == "1":
        _warnings_carry_their_exception()
    try:
        check_removed_flags(argv)
        args = build_parser().parse_args(argv)
        check_text_args(args)
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


def _warnings_carry_their_exception() -> None:
    """VERISPEC_DEBUG=1: a verispec warning logged while an exception is being handled carries
    that exception's traceback. A plugin's fault (its propose, commit, new_state... raised: the
    speculator is switched off with one warning, decoding goes on) is reported from inside the
    handler that caught it, so its traceback points at the plugin's line."""
    import logging

    make_record = logging.getLogRecordFactory()

    def record(*args, **kwargs):
        rec = make_record(*args, **kwargs)
        if (rec.exc_info is None and rec.levelno >= logging.WARNING and rec.name.startswith("verispec")
                and sys.exc_info()[0] is not None):
            rec.exc_info = sys.exc_info()
        return rec

    logging.setLogRecordFactory(record)


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

