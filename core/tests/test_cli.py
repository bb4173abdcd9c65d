"""The `verispec` command in a subprocess, with plugins installed as on-disk dist-info
folders (the toy plugin, and one that fails to import)."""
import json
import os
import subprocess
import sys

import pytest

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
    code = "import sys; from verispec.cli import main; rc = main(sys.argv[1:]); " \
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
    assert toy["target", "toy"]["architectures"] == ["toy"]
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


@pytest.mark.parametrize("args,message", [(["--spec-draft", "0"], "--spec-draft 0: choose 1..64"),
                                          (["--spec-pmin", "2"], "--spec-pmin 2.0: choose 0.0..1.0"),
                                          (["--temperature", "-1"], "--temperature -1.0")])
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
