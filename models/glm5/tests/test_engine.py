"""The engine on each architecture's tiny file: `--spec-type mtp` (the NextN head) and `--spec-type
ngram` stream exactly the plain greedy tokens, in-process (verispec.load) and through the CLI in a
subprocess (the TrunkSpec found through the installed entry point). glm-dsa's streams run past
index_topk, so the indexer restricts attention in the verifies; glm5-next's past index_topk + kpool,
and every rejected draft row rolls its KDA state back by `keep`."""
import json
import subprocess
import sys

import pytest
from glm_archs import ARCHS

pytest.importorskip("transformers")

PROMPT_IDS = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12] * 2
PROMPT = "the cat sat on the mat. the cat sat on the mat."
SPEC_TYPES = {"mtp": "verispec_mtp_nextn", "ngram": "verispec_ngram"}


def _tokens(engine, n=40):
    generation = engine.generate(PROMPT_IDS, max_tokens=n, ignore_eos=True)
    return [e.token for e in generation], generation.result


@pytest.mark.parametrize("spec_type", list(SPEC_TYPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_engine_speculation_streams_the_plain_tokens(tiny_glm, arch, spec_type):
    import verispec

    pytest.importorskip(SPEC_TYPES[spec_type])
    path = tiny_glm(arch)[2]
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


@pytest.mark.parametrize("spec_type", list(SPEC_TYPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cli_generate_gives_the_plain_tokens(tiny_glm, arch, spec_type):
    pytest.importorskip(SPEC_TYPES[spec_type])
    path = tiny_glm(arch)[2]
    spec = _generate(path, "--spec-type", spec_type, "--spec-adaptive", "off", "--spec-pmin", "0")
    plain = _generate(path, "--no-spec")
    assert spec["speculator"] == spec_type and spec["drafted"] > 0
    assert plain["speculator"] is None and spec["tokens"] == plain["tokens"]
