"""`verispec` command line: argument wiring only (torch is imported lazily, per command)."""
from __future__ import annotations

import argparse
import json
import os
import sys

#: removed spellings → their replacement; using one is an error, never a silent ignore.
REMOVED_FLAGS = {
    "--mtp-spec": "--spec",
    "--mtp-draft": "--spec-draft",
    "--mtp-pmin": "--spec-pmin",
    "--mtp-draft-model": "--draft-model",
    "--spec-draft-model": "--draft-model",
}

DEFAULT_PROMPT = "The lighthouse keeper climbed the stairs and"


class CliError(Exception):
    """A usage problem: printed as `verispec: error: ...`, exit status 2."""


def _ranged(kind, lo, hi, name):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r}: not a number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{name} {value}: choose {lo}..{hi}")
        return value
    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF path or checkpoint alias (default: the embedded default model)")
    p.add_argument("--dtype", choices=["int8", "int4", "bf16", "fp32"], help="weight dtype (default: the model's choice)")
    p.add_argument("--threads", type=_ranged(int, 1, 1024, "--threads"))
    p.add_argument("--context-length", type=_ranged(int, 16, 1 << 20, "--context-length"))


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--spec", dest="spec", action="store_true", default=True, help="speculate when it pays (default)")
    g.add_argument("--no-spec", dest="spec", action="store_false", help="plain decoding")
    g.add_argument("--spec-type", default="auto", help="auto | draft-head | block | ngram | <registered name>")
    g.add_argument("--spec-draft", type=_ranged(int, 1, 64, "--spec-draft"), help="draft window K (default 8)")
    g.add_argument("--spec-pmin", type=_ranged(float, 0.0, 1.0, "--spec-pmin"), help="draft gate (per algorithm)")
    g.add_argument("--draft-model", help="drafter GGUF; its general.architecture decides what it is")
    g.add_argument("--spec-adaptive", choices=["on", "off"], default="on", help="off forces drafting")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_ranged(int, 1, 1 << 20, "--max-tokens"), default=128)
    g.add_argument("--temperature", type=_ranged(float, 0.0, 100.0, "--temperature"), default=0.0)
    g.add_argument("--top-k", type=_ranged(int, 0, 1 << 24, "--top-k"), default=0)
    g.add_argument("--top-p", type=_ranged(float, 1e-9, 1.0, "--top-p"), default=1.0)
    g.add_argument("--min-p", type=_ranged(float, 0.0, 1.0, "--min-p"), default=0.0)
    g.add_argument("--repetition-penalty", type=_ranged(float, 1e-3, 100.0, "--repetition-penalty"), default=1.0)
    g.add_argument("--frequency-penalty", type=_ranged(float, -2.0, 2.0, "--frequency-penalty"), default=0.0)
    g.add_argument("--presence-penalty", type=_ranged(float, -2.0, 2.0, "--presence-penalty"), default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Speculative decoding, exactly.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
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
    bench.add_argument("--max-tokens", type=_ranged(int, 1, 1 << 16, "--max-tokens"),
                       help="new tokens per turn (default: each scenario's own)")
    bench.add_argument("--repeats", type=_ranged(int, 1, 100, "--repeats"), default=1,
                       help="plain/spec pairs per scenario; speeds are medians")

    cache = sub.add_parser("cache", help="show or clear assembled checkpoints and converted weights")
    cache.add_argument("--clear", action="store_true")

    chat = sub.add_parser("chat", help="interactive chat on stdin (one line per turn; /reset; Ctrl-D exits)")
    _add_model_args(chat)
    _add_spec_args(chat)
    _add_sampling_args(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    serve.add_argument("--port", type=_ranged(int, 0, 65535, "--port"), default=8000)
    _add_model_args(serve)
    _add_spec_args(serve)
    return parser


def _check_removed_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REMOVED_FLAGS:
            raise CliError(f"{flag} was removed; use {REMOVED_FLAGS[flag]} instead")


def spec_options(args):
    from verispec.engine import SpecOptions

    return SpecOptions(enabled=args.spec, spec_type=args.spec_type, draft_window=args.spec_draft,
                       min_draft_prob=args.spec_pmin, draft_model=args.draft_model,
                       adaptive=args.spec_adaptive == "on")


def sampling_params(args):
    from verispec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, seed=args.seed)


def load_engine(args):
    from verispec.api import load

    return load(args.model, dtype=args.dtype, threads=args.threads, context_length=args.context_length,
                spec=spec_options(args))


def cmd_plugins(args) -> int:
    from verispec.registry import Registry, format_plugin_table

    rows = Registry.discover().plugin_rows()
    print(json.dumps(rows, indent=1) if args.json else format_plugin_table(rows))
    return 0


def cmd_generate(args) -> int:
    sampling = sampling_params(args)
    engine = load_engine(args)
    generation = engine.generate(args.prompt, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop,
                                 ignore_eos=args.ignore_eos, chat=args.chat)
    for event in generation:
        if not args.json:
            print(event.text, end="", flush=True)
    r = generation.result
    summary = (f"{len(r.tokens)} tokens, finish={r.finish_reason}, ttft {r.ttft_ms:.0f} ms, "
               f"decode {r.decode_tokens_per_s:.1f} tok/s, speculator={r.speculator}, "
               f"drafted={r.spec.num_draft_tokens} accepted={r.spec.num_accepted_tokens}")
    if args.json:
        print(json.dumps({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                          "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens)},
                          "ttft_ms": r.ttft_ms, "decode_tokens_per_s": r.decode_tokens_per_s,
                          "speculator": r.speculator, "drafted": r.spec.num_draft_tokens,
                          "accepted": r.spec.num_accepted_tokens, "governor": r.governor}))
    else:
        print(f"\n\n[{summary}]" + (f"\n[{r.governor}]" if r.governor else ""), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from verispec.bench import load_scenarios, run_bench

    spec, scenarios = spec_options(args), load_scenarios(args.scenario)  # bad input fails before the model loads
    return run_bench(load_engine(args), spec, scenarios, max_tokens=args.max_tokens, repeats=args.repeats,
                     as_json=args.json)


def cmd_chat(args) -> int:
    from verispec.chat import run_chat

    sampling = sampling_params(args)
    engine = load_engine(args)
    return run_chat(engine, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop,
                    ignore_eos=args.ignore_eos)


def cmd_serve(args) -> int:
    try:
        from verispec.server import serve
    except ImportError as e:
        raise CliError(f"verispec serve needs FastAPI and uvicorn ({e}); pip install 'verispec[serve]'") from None

    engine = load_engine(args)
    serve(engine, host=args.host, port=args.port, model_name=args.model or "default")
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
        return COMMANDS[args.command](args)
    except CliError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- user errors print one line; anything else is a bug
        if not _is_user_error(e) or os.environ.get("VERISPEC_DEBUG") == "1":
            raise
        print(f"verispec: error: {e}", file=sys.stderr)
        return 1


def _is_user_error(error: Exception) -> bool:
    """Bad input (a foreign GGUF, an unknown model, a speculator that cannot serve, a prompt
    too long...): our error classes carry the fix in their message, so one line is enough.
    Set VERISPEC_DEBUG=1 to see the traceback anyway."""
    from verispec.gguf_io import GGUFError
    from verispec.registry import SpeculationUnavailable

    return isinstance(error, (ValueError, LookupError, OSError, GGUFError, SpeculationUnavailable))


if __name__ == "__main__":
    sys.exit(main())
