"""The engine on the tiny glm5-next file: `--spec-type mtp` (the NextN head) and `--spec-type ngram`
stream exactly the plain greedy tokens, in-process (verispec.load) and through the CLI in a
subprocess (the TrunkSpec found through the installed entry point). The streams run past
index_topk + kpool, so the k-pool selection restricts attention in the verifies, and every
rejected draft row rolls the KDA state back by `keep`."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

PROMPT_IDS = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12] * 2
PROMPT = "the cat sat on the mat. the cat sat on the mat."


def _tokens(engine, n=40):
    generation = engine.generate(PROMPT_IDS, max_tokens=n, ignore_eos=True)
    return [e.token for e in generation], generation.result


@pytest.mark.parametrize("spec_type", ["mtp", "ngram"])
def test_engine_speculation_streams_the_plain_tokens(tiny_glm5next_fixture, spec_type):
    import verispec

    pytest.importorskip("verispec_mtp_nextn" if spec_type == "mtp" else "verispec_ngram")
    path = tiny_glm5next_fixture("flash")[1]
    plain, _ = _tokens(verispec.load(path, enabled=False))
    got, result = _tokens(verispec.load(path, spec_type=spec_type, adaptive=False, min_draft_prob=0.0))
    assert got == plain
    assert result.speculator == spec_type and result.spec.num_draft_tokens > 0


def _generate(path, *flags):
    cmd = [sys.executable, "-m", "verispec.cli", "generate", "--model", path, "--max-tokens", "32", "--json",
           "--threads", "1", *flags, PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec_type", ["mtp", "ngram"])
def test_cli_generate_gives_the_plain_tokens(tiny_glm5next_fixture, spec_type):
    pytest.importorskip("verispec_mtp_nextn" if spec_type == "mtp" else "verispec_ngram")
    path = tiny_glm5next_fixture("flash")[1]
    spec = _generate(path, "--spec-type", spec_type, "--spec-adaptive", "off", "--spec-pmin", "0")
    plain = _generate(path, "--no-spec")
    assert spec["speculator"] == spec_type and spec["drafted"] > 0
    assert plain["speculator"] is None and spec["tokens"] == plain["tokens"]
