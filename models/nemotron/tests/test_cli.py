"""`verispec generate` on a tiny Nemotron-H fixture, in a subprocess (entry points as installed):
the trunk speculates (README.md "Verdict"), so the ngram speculator drafts, the counters show
it, and the tokens are the plain greedy stream's."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

PROMPT = "the cat sat on the mat. the cat sat on the mat."


def generate(path, *flags):
    cmd = [sys.executable, "-m", "verispec.cli", "generate", "--model", path, "--max-tokens", "48", "--json",
           "--threads", "1", *flags, PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_generate_speculates_with_visible_counters_and_plain_tokens(tiny_fixture):
    _, path = tiny_fixture("dense")
    spec, stderr = generate(path, "--spec-type", "ngram", "--spec-adaptive", "off")
    plain, _ = generate(path, "--no-spec")
    assert spec["speculator"] == "ngram"
    assert spec["drafted"] > 0 and spec["accepted"] > 0
    assert "speculation off" not in stderr
    assert plain["speculator"] is None and plain["drafted"] == 0
    assert spec["tokens"] == plain["tokens"]
