"""The `verispec` command in a subprocess, with plugins installed as on-disk dist-info
folders (the toy plugin, and one that fails to import)."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from verispec.reasons import REASON_CODES
from verispec.testing.terminal import default_sigint, stderr_on_a_terminal
from verispec.testing.toy import write_toy_gguf


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    for dist, ep, module_source in [
        ("verispec-toy", "toy = verispec.testing.toy_plugin", None),
        ("verispec-broken", "broken = broken_plugin", 'raise ImportError("needs libbroken 2.0")\n'),
    ]:
        info = root / f"{dist.replace('-', '_')}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[verispec]\n{ep}\n")
        if module_source:
            (root / "broken_plugin.py").write_text(module_source)
    return {**os.environ, "PYTHONPATH": str(root)}


def verispec(env, *args):
    code = "import sys; from verispec.cli.main import main; rc = main(sys.argv[1:]); " \
           "print('TORCH_LOADED' if 'torch' in sys.modules else '', file=sys.stderr); sys.exit(rc)"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


def test_plugins_json_lists_good_plugins_and_reports_the_broken_one_without_torch(env):
    r = verispec(env, "plugins", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    toy = {(row["kind"], row["name"]): row for row in rows if row["distribution"] == "verispec-toy"}
    speculator = toy["speculator", "toy-block"]
    assert speculator["version"] == "0.1.0" and speculator["plugin"] == "toy"
    assert speculator["requires_draft_head"] is True and speculator["can_arm_after_prefix_reuse"] is False
    assert speculator["needs_hidden_state"] is True and speculator["default_min_draft_prob"] == 0.35
    assert toy["trunk", "toy"]["architectures"] == ["toy"]
    assert toy["draft_file", "toy-block"]["architectures"] == ["toy-block-drafter"]
    broken = [row for row in rows if row["kind"] == "error"]
    assert len(broken) == 1 and "needs libbroken 2.0" in broken[0]["error"]
    assert broken[0]["distribution"] == "verispec-broken"
    assert "TORCH_LOADED" not in r.stderr


@pytest.mark.parametrize("flag,replacement", [("--mtp-spec", "--spec"), ("--mtp-draft=4", "--spec-draft"),
                                              ("--mtp-pmin", "--spec-pmin"), ("--mtp-draft-model", "--draft-model"),
                                              ("--spec-draft-model", "--draft-model")])
def test_removed_flags_fail_naming_their_replacement(env, flag, replacement):
    r = verispec(env, "generate", flag)
    assert r.returncode != 0
    assert f"use {replacement} instead" in r.stderr


@pytest.mark.parametrize("args,replacement", [(["--draft-max", "8"], "--spec-draft"),
                                              (["--draft=8"], "--spec-draft"), (["--draft-n", "8"], "--spec-draft"),
                                              (["--draft-p-min", "0.5"], "--spec-pmin"),
                                              (["--model-draft", "d.gguf"], "--draft-model"),
                                              (["-md", "d.gguf"], "--draft-model")])
def test_llama_cpp_flags_fail_naming_verispecs(env, args, replacement):
    """Not argparse's bare "unrecognized arguments", nor `--draft 8` read as --draft-model 8."""
    r = verispec(env, "generate", "hi", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    flag = args[0].split("=")[0]
    assert f"verispec: error: {flag} is llama.cpp's spelling; verispec's is {replacement}" in r.stderr


@pytest.mark.parametrize("args,message", [(["--spec-draft", "0"], "argument --spec-draft: 0: choose 1..64"),
                                          (["--spec-pmin", "2"], "argument --spec-pmin: 2.0: choose 0.0..1.0"),
                                          (["--temperature", "-1"], "argument --temperature: -1.0: choose")])
def test_impossible_flags_are_rejected(env, args, message):
    r = verispec(env, "generate", *args)
    assert r.returncode != 0 and message in r.stderr


def test_generate_on_a_toy_gguf(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hello hello hello", "--model", str(path), "--max-tokens", "12", "--json",
                 "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12 and out["usage"]["completion_tokens"] == 12


def test_compare_plain_decodes_the_prompt_plainly_too_and_says_whether_the_tokens_match(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hello hello hello", "--model", str(path), "--max-tokens", "12", "--ignore-eos",
                 "--compare-plain", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plain"]["identical"] is True and out["plain"]["decode_tokens_per_s"] > 0
    assert out["reason"]["code"] in REASON_CODES and out["reason"]["text"]
    r = verispec(env, "generate", "hello hello hello", "--model", str(path), "--max-tokens", "12", "--ignore-eos",
                 "--compare-plain")
    assert re.search(r"\[same prompt, plain decoding: [\d.]+ tok/s; speculative [\d.]+ tok/s \([\d.]+x\); "
                     r"identical: yes\]", r.stderr), r.stderr


def test_the_comparison_line_says_no_when_the_streams_differ():
    from types import SimpleNamespace

    from verispec.cli.main import comparison_line
    spec = SimpleNamespace(tokens=[1, 2, 3], decode_tokens_per_s=60.0)
    assert comparison_line(spec, SimpleNamespace(tokens=[1, 2, 3], decode_tokens_per_s=30.0)) == (
        "[same prompt, plain decoding: 30.0 tok/s; speculative 60.0 tok/s (2.00x); identical: yes]")
    assert "identical: NO" in comparison_line(spec, SimpleNamespace(tokens=[1, 2, 4], decode_tokens_per_s=30.0))


def test_generate_reads_the_prompt_dash_from_standard_input(env, tmp_path):
    """`generate -`: a prompt past the OS's argument limit (~128 KiB) comes on stdin, UTF-8."""
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    run = lambda data: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, "generate", "-", "--model", str(path), "--max-tokens", "4", "--json",
         "--ignore-eos", "--no-spec"], input=data, env=env, capture_output=True, timeout=120)
    piped, argv = run(b"hello hello hello"), verispec(env, "generate", "hello hello hello", "--model", str(path),
                                                       "--max-tokens", "4", "--json", "--ignore-eos", "--no-spec")
    assert piped.returncode == 0 and argv.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["tokens"] == json.loads(argv.stdout)["tokens"]
    assert json.loads(piped.stdout)["usage"]["prompt_tokens"] == json.loads(argv.stdout)["usage"]["prompt_tokens"]
    bad = run(b"hi \xe9 there")
    assert bad.returncode == 1 and b"the prompt on standard input is not UTF-8 text: byte 0xe9" in bad.stderr


def test_generate_takes_a_kv_budget_and_refuses_one_too_small_for_any_request(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hello", "--model", str(path), "--max-tokens", "4", "--kv-cache-gb", "1")
    assert r.returncode == 0, r.stderr
    r = verispec(env, "generate", "hello", "--model", str(path), "--kv-cache-gb", "1e-9")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "raise --kv-cache-gb (kv_cache_gb=) to at least" in r.stderr


def test_explicit_spec_type_that_cannot_serve_exits_non_zero_with_the_reason(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hi", "--model", str(path), "--spec-type", "toy-block")
    assert r.returncode != 0 and "no draft head" in r.stderr


def test_unknown_model_alias_names_what_is_installed(env):
    r = verispec(env, "generate", "hi", "--model", "no-such-model")
    assert r.returncode != 0 and "no-such-model" in r.stderr


def test_foreign_and_truncated_files_are_one_line_errors(env, tmp_path):
    foreign = tmp_path / "passwd.gguf"
    foreign.write_text("root:x:0:0:root:/root:/bin/bash\n")
    r = verispec(env, "generate", "hi", "--model", str(foreign))
    assert r.returncode == 1 and "is not a GGUF file" in r.stderr and "Traceback" not in r.stderr
    whole = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(whole, "rb").read()[:600])
    r = verispec(env, "generate", "hi", "--model", str(cut))
    assert r.returncode == 1 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_path_and_unknown_spec_type_are_one_line_errors(env, tmp_path):
    r = verispec(env, "generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 1 and "no such GGUF file" in r.stderr and "Traceback" not in r.stderr
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hi", "--model", str(path), "--spec-type", "nosuchalgo")
    assert r.returncode == 1 and "nosuchalgo" in r.stderr and "Traceback" not in r.stderr


# -- exit codes and one-line messages -----------------------------------------------------------

def run_code(env, code, *args, **kwargs):
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, timeout=120, **kwargs)


def test_a_prompt_that_is_not_utf8_is_an_error_naming_the_byte(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    for args in ([b"caf\xe9 au lait"], [b"ok", b"--stop", b"x\xff"]):
        r = run_code(env, code, "generate", "--model", str(path), *args)
        stderr = r.stderr.decode()
        assert r.returncode == 1, stderr  # bad input, as on standard input; not a bad flag
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in stderr and "usage:" not in stderr
        assert "is not UTF-8 text: byte 0x" in lines[0] and "at byte" in lines[0]
    assert "byte 0xe9 at byte 3" in run_code(env, code, "generate", b"caf\xe9").stderr.decode()
    # a path is the OS's business: a non-UTF-8 name is looked up as given
    r = run_code(env, code, "generate", "hi", "--model", os.fsencode(tmp_path) + b"/n\xe9.gguf")
    assert r.returncode == 1 and b"no such GGUF file" in r.stderr and b"Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["generate", "--stop", ""], "argument --stop: stop strings must be non-empty"),
    (["generate", "--max-tokens", "0"], "argument --max-tokens: 0: choose 1..1048576"),
    (["generate", "--bogus"], "unrecognized arguments: --bogus"),
    (["serve", "--request-timeout", "0"], "argument --request-timeout: 0.0: choose 0.01..10000000.0"),
    (["serve", "--max-running", "0"], "argument --max-running: 0: choose 1..1024"),
    ([], "the following arguments are required: command"),
])
def test_bad_flags_print_the_error_and_a_one_line_usage(env, args, message):
    r = verispec(env, *args)
    lines = [line for line in r.stderr.splitlines() if line]  # the helper adds one line of its own
    assert r.returncode == 2 and message in lines[0], r.stderr
    assert lines[1].startswith("usage: verispec") and "(--help lists the flags)" in lines[1]
    assert len(lines) == 2 and r.stdout == ""


def test_plugins_into_a_closed_pipe_is_quiet(env):
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen([sys.executable, "-c", code, "plugins"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader left before the first line (`verispec plugins | head -0`)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert b"Broken pipe" not in stderr and b"Exception ignored" not in stderr and b"Traceback" not in stderr
    assert stderr.decode().splitlines() == [line for line in stderr.decode().splitlines() if "libbroken" in line]


def test_ctrl_c_prints_one_line_and_exits_130(env):
    code = ("import sys, time; import verispec.cli.main as cli\n"
            "def slow(args):\n    print('ready', flush=True)\n    time.sleep(60)\n"
            "cli.COMMANDS['plugins'] = slow\nsys.exit(cli.main(['plugins']))")
    process = subprocess.Popen([sys.executable, "-c", code], env=env, preexec_fn=default_sigint,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and stderr == "verispec: interrupted\n"


@pytest.mark.parametrize("raised,rc,one_line", [
    ("IndexError('index 274489 is out of bounds')", 70, False),
    ("KeyError('blk.0.attn_q.weight')", 70, False),
    ("ValueError('a bare ValueError is a bug')", 70, False),
    ("OSError(28, 'No space left on device')", 70, False),
    ("__import__('verispec.errors').errors.InvalidArgument('bad input, the fix')", 1, True),
    ("FileNotFoundError(2, 'No such file', 'x.gguf')", 1, True),
])
def test_only_verispecs_own_errors_are_one_line_user_errors(env, raised, rc, one_line):
    code = ("import sys; import verispec.cli.main as cli\n"
            f"def command(args):\n    raise {raised}\n"
            "cli.COMMANDS['plugins'] = command\nsys.exit(cli.main(['plugins']))")
    r = run_code(env, code, text=True)
    assert r.returncode == rc, r.stderr
    if one_line:
        assert r.stderr.startswith("verispec: error: ") and len(r.stderr.splitlines()) == 1
    else:
        assert "Traceback (most recent call last)" in r.stderr
        assert r.stderr.splitlines()[-1].startswith("verispec: internal error (a bug in verispec or a plugin")


def test_chat_on_a_model_without_a_template_is_a_one_line_error(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hi", "--model", str(path), "--chat")
    assert r.returncode == 1 and "has no tokenizer.chat_template" in r.stderr and "Traceback" not in r.stderr
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "chat", "--model", str(path), "--no-spec"], input="hi\n",
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert "has no chat template" in r.stderr and "use `verispec generate` with plain text" in r.stderr
    assert "--chat" not in r.stderr


@pytest.mark.parametrize("command, template, problem", [
    (["chat"], "{% for m in messages %}\n{{ m.content }\n{% endfor %}", "syntax error at line 2: unexpected '}'"),
    (["chat"], "{{ raise_exception('no chat here') }}", "the chat template refused these messages: no chat here"),
    (["chat"], "{{ ''.__class__.__mro__ }}", "the sandbox stopped it"),
    (["generate", "hi", "--chat"], "{{ 'x' * 10**10 }}", "'*' would build a value longer than"),
])
def test_chat_with_a_failing_template_is_a_one_line_error(env, tmp_path, command, template, problem):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110, chat_template=template)
    r = verispec(env, *command, "--model", str(path))
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("verispec: error: ")]
    assert len(errors) == 1 and problem in errors[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.real_checkpoint
def test_a_context_length_beyond_the_models_training_is_a_one_line_error(gemma3_270m_spec):
    r = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--model", "gemma3-270m",
                        "--context-length", "1000000", "--max-tokens", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("verispec: error: --context-length 1000000 exceeds the 32768")
    assert len(r.stderr.splitlines()) == 1, r.stderr


# -- what ended a run, a directory as --model, the last line -----------------------------------

def test_plain_text_output_ends_with_a_newline_and_a_full_context_is_named(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hello hello", "--model", str(path), "--max-tokens", "16",
                 "--context-length", "16", "--ignore-eos", "--no-spec")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    assert "finish=length (context full at 16 tokens; --context-length sets it)" in r.stderr
    r = verispec(env, "generate", "hi", "--model", str(path), "--max-tokens", "17", "--context-length", "16")
    assert r.returncode == 1 and "--max-tokens 17 is more than the 16-token context can hold" in r.stderr
    assert "lower it, or load the model with a larger --context-length, up to 512" in r.stderr  # the file's trained length
    r = verispec(env, "generate", "hello hello", "--model", str(path), "--max-tokens", "3", "--ignore-eos")
    assert "finish=length," in r.stderr  # --max-tokens itself ended it: nothing to explain


def test_a_directory_as_model_names_the_gguf_files_inside(env, tmp_path):
    write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "generate", "hi", "--model", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "a directory; give the .gguf file itself (here: toy.gguf)" in r.stderr


BENCH = ("bench", "--scenario", "echo-own", "--max-tokens", "12", "--spec-type", "ngram", "--threads", "1")
needs_ngram = pytest.mark.skipif(importlib.util.find_spec("verispec_ngram") is None,
                                 reason="BENCH drafts with ngram: pip install -e plugins/ngram")


@needs_ngram
def test_bench_plot_writes_a_png_of_both_panels(env, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'matplotlib>=3.8' (./scripts/setup.sh installs it)")
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, *BENCH, "--model", str(path), "--plot", str(tmp_path / "out.png"))
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "out.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(png) < 2_000_000
    assert "trace: echo-own" in r.stderr and r.stdout.startswith("scenario | prompt")


def test_bench_plot_without_matplotlib_fails_before_the_model_loads(env, tmp_path):
    blocker = tmp_path / "site" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("no matplotlib here")\n')
    env = {**env, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{env['PYTHONPATH']}"}
    r = verispec(env, *BENCH, "--model", str(tmp_path / "absent.gguf"), "--plot", str(tmp_path / "out.png"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--plot needs matplotlib" in r.stderr and "-m pip install 'matplotlib>=3.8'" in r.stderr


def test_bench_diagnostic_json_shows_zero_error_on_a_batch_invariant_trunk(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    r = verispec(env, "bench", "--diagnostic", "--json", "--scenario", "prose", "--max-tokens", "24",
                 "--spec-draft", "3", "--model", str(path))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["batch_invariant"] and report["ok"] and report["max_draft_tokens"] == 3
    assert {row["name"] for row in report["rows"]} >= {"verify row 0", "verify row 3", "kept-prefix row"}
    assert all(row["max_abs_error"] == 0 for row in report["rows"]) and report["flips"] == []


def _bench_stderr_on_a_terminal(env, args) -> str:
    """stderr of `verispec bench` written to a pseudo-terminal."""
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    rc, err = stderr_on_a_terminal([sys.executable, "-c", code, *args], env=env)
    assert rc == 0, err
    return err


@needs_ngram
def test_bench_progress_is_drawn_on_a_terminal_and_silent_otherwise(env, tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    args = [*BENCH, "--model", str(path)]
    piped = verispec(env, *args)
    assert piped.returncode == 0, piped.stderr
    assert "bench" not in piped.stderr and "\r" not in piped.stderr
    terminal = _bench_stderr_on_a_terminal(env, args)
    assert "bench 1/1 echo-own: plain" in terminal and "bench 1/1 echo-own: spec" in terminal
