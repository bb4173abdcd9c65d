"""`verispec chat` (verispec.chat.repl.run_chat) fed a scripted stdin, on the toy plugin's GGUF with
a chat template; each answer is checked against a fresh plain engine given the same conversation."""
import io
import os
import re
import subprocess
import sys

import pytest

from verispec import api
from verispec.chat.repl import run_chat
from verispec.engine import SpecOptions
from verispec.hookspecs import hookimpl
from verispec.registry import Registry
from verispec.sampling import SamplingParams
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import CHAT_TEMPLATE, ScriptedSpeculator, write_toy_gguf

SAMPLING = SamplingParams(temperature=0.8, seed=7)
MAX_TOKENS = 12
CAT, DOG = "where is the cat?", "and the dog?"
#: "[12 tokens, finish=length, reused 45/77 prompt tokens, ..." — run_chat's per-turn line.
SUMMARY = re.compile(r"^\[(\d+) tokens, finish=(\w+), reused (\d+)/(\d+) prompt tokens", re.MULTILINE)


class RepeatPlugin:
    """A speculator drafting the pending token again and again (cheap, often right on a toy)."""

    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="repeat", summary="repeats the last token (test)", priority=10,
                                factory=lambda trunk, **kw: ScriptedSpeculator(
                                    lambda ctx: [ctx.last_token] * ctx.max_draft_tokens,
                                    max_draft_tokens=kw["max_draft_tokens"], spec=kw["spec"])))


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin, "repeat": RepeatPlugin()})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "chat.gguf", vocab_size=110, recurrent=False, seed=4,
                          chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def fresh_answer(model_path, registry):
    """What a plain engine with an empty cache answers to `messages`."""
    def answer(messages):
        engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
        generation = engine.generate(messages, max_tokens=MAX_TOKENS, sampling=SAMPLING, ignore_eos=True)
        list(generation)
        return generation.result.text
    return answer


def chat(engine, script: str, stdin_class=io.StringIO):
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(engine, sampling=SAMPLING, max_tokens=MAX_TOKENS, ignore_eos=True, stdin=stdin_class(script),
                  stdout=out, stderr=err)
    summaries = [tuple(int(g) if g.isdigit() else g for g in m.groups()) for m in SUMMARY.finditer(err.getvalue())]
    return rc, out.getvalue(), err.getvalue(), summaries


def test_two_turns_keep_the_conversation_and_reuse_the_prefix(model_path, registry, fresh_answer):
    engine = api.load(model_path, registry=registry, spec_type="repeat", adaptive=False)
    rc, out, err, summaries = chat(engine, f"{CAT}\n{DOG}\n")
    first = fresh_answer([{"role": "user", "content": CAT}])
    second = fresh_answer([{"role": "user", "content": CAT}, {"role": "assistant", "content": first},
                           {"role": "user", "content": DOG}])
    assert rc == 0 and out == f"{first}\n{second}\n"
    (n1, finish1, reused1, prompt1), (n2, _, reused2, prompt2) = summaries
    assert n1 == n2 == MAX_TOKENS and finish1 == "length" and reused1 == 0
    # the second prompt starts with the first prompt and the first answer (re-encoded, so its
    # tokens may split differently from the sampled ones): at least the first prompt is reused
    assert prompt1 <= reused2 < prompt2
    assert err.count("[governor plain=") == 2 and "speculator=repeat" in err


def test_reset_starts_a_new_conversation(model_path, registry, fresh_answer):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    rc, out, err, summaries = chat(engine, f"{CAT}\n/reset\n{CAT}\n")
    first = fresh_answer([{"role": "user", "content": CAT}])
    assert rc == 0 and out == f"{first}\n{first}\n" and "[new conversation]" in err
    assert summaries[0][3] == summaries[1][3]  # the same one-turn prompt
    assert "[governor" not in err


def test_blank_lines_and_unknown_commands_send_nothing(model_path, registry, fresh_answer):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    rc, out, err, summaries = chat(engine, f"\n   \n/rest\n{CAT}\n")
    assert rc == 0 and out == fresh_answer([{"role": "user", "content": CAT}]) + "\n" and len(summaries) == 1
    assert "unknown command /rest: /reset starts a new conversation" in err


def test_a_turn_the_engine_refuses_is_reported_and_left_out(model_path, registry, fresh_answer):
    engine = api.load(model_path, registry=registry, context_length=64, spec=SpecOptions(enabled=False))
    rc, out, err, summaries = chat(engine, "x" * 80 + f"\n{CAT}\n")
    assert rc == 0 and "shorten the prompt" in err
    assert "/reset starts" not in err  # a first turn: there is no conversation to reset
    assert out == fresh_answer([{"role": "user", "content": CAT}]) + "\n" and len(summaries) == 1


def test_a_template_error_is_reported_and_the_chat_goes_on(tmp_path, registry):
    template = ("{% if messages[-1]['content'] == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
                + CHAT_TEMPLATE)
    path = write_toy_gguf(tmp_path / "picky.gguf", vocab_size=110, recurrent=False, seed=4, chat_template=template)
    engine = api.load(path, registry=registry, spec=SpecOptions(enabled=False))
    rc, _, err, summaries = chat(engine, f"bad\n{CAT}\n")
    assert rc == 0 and "verispec: error: the chat template refused these messages: no bad words" in err and len(summaries) == 1


def test_a_model_without_a_chat_template_is_bad_input_naming_verispec_generate(tmp_path, registry):
    engine = api.load(write_toy_gguf(tmp_path / "plain.gguf", vocab_size=110), registry=registry)
    rc, out, err, _ = chat(engine, f"{CAT}\n")
    assert rc == 1 and out == "" and len(err.splitlines()) == 1
    assert "has no chat template" in err and "`verispec generate` with plain text" in err and "--chat" not in err


def test_a_terminal_gets_help_and_a_prompt(model_path, registry):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    rc, _, err, _ = chat(engine, f"{CAT}\n", stdin_class=Terminal)
    assert rc == 0 and err.startswith("[/reset starts a new conversation; end of input (Ctrl-D) exits]\n> ")
    assert err.count("> ") == 2  # before the turn and before end of input


def test_verispec_chat_command(tmp_path, model_path):
    info = tmp_path / "verispec_toy-0.1.0.dist-info"  # the toy plugin, installed for the subprocess
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verispec-toy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[verispec]\ntoy = verispec.testing.toy_plugin\n")
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "chat", "--model", str(model_path), "--max-tokens", "5",
                        "--ignore-eos", "--temperature", "0.8", "--seed", "7"], input=f"{CAT}\n/reset\n{CAT}\n",
                       env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.split("\n")
    assert len(answers) == 3 and answers[0] == answers[1] and answers[2] == ""
    assert [m.group(1) for m in SUMMARY.finditer(r.stderr)] == ["5", "5"]


def test_a_line_that_is_not_utf8_is_reported_and_the_chat_goes_on(model_path, registry, fresh_answer):
    """`verispec chat` reads stdin with surrogateescape: a non-UTF-8 line is named and left out."""
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    rc, out, err, summaries = chat(engine, "caf\udce9 au lait\n" + f"{CAT}\n")
    assert rc == 0 and "that line is not UTF-8 text: byte 0xe9 at byte 3 is not valid UTF-8" in err
    assert out == fresh_answer([{"role": "user", "content": CAT}]) + "\n" and len(summaries) == 1


def test_verispec_chat_with_a_non_utf8_stdin_line(tmp_path, model_path):
    info = tmp_path / "verispec_toy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verispec-toy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[verispec]\ntoy = verispec.testing.toy_plugin\n")
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "chat", "--model", str(model_path), "--max-tokens", "3",
                        "--ignore-eos"], input=b"caf\xe9\n" + CAT.encode() + b"\n",
                       env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, timeout=120, check=False)
    stderr = r.stderr.decode()
    assert r.returncode == 0, stderr
    assert "byte 0xe9 at byte 3" in stderr and "Traceback" not in stderr
    assert [m.group(1) for m in SUMMARY.finditer(stderr)] == ["3"]
