"""`verispec chat`: an interactive conversation on stdin, one user turn per line.

The conversation is kept and sent whole each turn, rendered through the model's chat
template, so the engine reuses the cached prefix (every earlier turn) and prefills only the
new one. Commands: `/reset` starts a new conversation; end of input (Ctrl-D) exits. After
each answer a summary line (and the governor's line when speculating) goes to stderr.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from verispec.engine import InferenceEngine
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.streamed_text import warnings_on_their_own_line
from verispec.tokenizer import NoChatTemplate, TokenizerError, text_problem

HELP = "/reset starts a new conversation; end of input (Ctrl-D) exits"


def run_chat(engine: InferenceEngine, *, sampling: SamplingParams | None = None, max_tokens: int = 512,
             stop: Sequence[str] = (), ignore_eos: bool = False, stdin: TextIO | None = None,
             stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Read user turns from `stdin` until it ends; stream each answer to `stdout`.

    sampling: how every turn draws (default greedy); max_tokens, stop, ignore_eos: per turn.

    Returns the exit status: 0, or 1 when the model has no chat template. A turn the
    engine rejects (e.g. the conversation outgrew the context) is reported on stderr and
    left out of the conversation.
    """
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    sampling = sampling or SamplingParams()
    try:
        engine.tokenizer.render_chat([{"role": "user", "content": ""}])
    except NoChatTemplate as e:
        print(f"verispec: error: this {e.architecture!r} model has no chat template (no "
              "tokenizer.chat_template in the GGUF, and verispec has no default for the family), so it "
              "cannot chat: use `verispec generate` with plain text, or a GGUF converted with its chat "
              "template", file=stderr)
        return 1
    except TokenizerError as e:
        print(f"verispec: error: {e}", file=stderr)
        return 1
    interactive = stdin.isatty()
    if interactive:
        print(f"[{HELP}]", file=stderr)
    messages: list[dict[str, str]] = []
    while True:
        if interactive:
            print("> ", end="", file=stderr, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            messages.clear()
            print("[new conversation]", file=stderr)
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]}: {HELP}]", file=stderr)
            continue
        problem = text_problem(text, os_bytes=True)
        if problem:  # stdin read with surrogateescape (cmd_chat): the turn is left out
            print(f"verispec: error: that line is not UTF-8 text: {problem}; type UTF-8 text", file=stderr)
            continue
        answer = _turn(engine, messages + [{"role": "user", "content": text}], sampling=sampling,
                       max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, stdout=stdout, stderr=stderr)
        if answer is not None:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _turn(engine, messages, *, sampling, max_tokens, stop, ignore_eos, stdout, stderr) -> str | None:
    """Stream one answer; returns its text, or None when the engine refused the turn."""
    try:
        generation = engine.generate(messages, max_tokens=max_tokens, sampling=sampling, stop=stop,
                                     ignore_eos=ignore_eos)
    except VerispecError as e:  # ContextOverflow, a template's raise_exception (ChatTemplateError)
        hint = " (/reset starts a new conversation)" if len(messages) > 1 else ""
        print(f"verispec: error: {e}{hint}", file=stderr)
        return None
    with warnings_on_their_own_line(stdout, stderr) as text:
        for event in generation:
            text.write(event.text)
    print(file=stdout, flush=True)
    r = generation.result
    print(f"[{len(r.tokens)} tokens, finish={r.finish_reason}, reused {r.reused_prefix_tokens}/{r.prompt_tokens} "
          f"prompt tokens, ttft {r.ttft_ms:.0f} ms, decode {r.decode_tokens_per_s:.1f} tok/s, "
          f"speculator={r.speculator}, drafted={r.spec.num_draft_tokens} accepted={r.spec.num_accepted_tokens}]"
          + (f"\n[{r.governor}]" if r.governor else ""), file=stderr)
    return r.text
