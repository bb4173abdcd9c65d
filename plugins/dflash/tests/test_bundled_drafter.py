"""The drafter shipped in the package (`dflash-smollm2-135m-instruct`, scripts/train_drafter.py): its
alias resolves to the bundled file (sha256-checked) and binds to SmolLM2-135M-Instruct, and
`generate` with it streams exactly the plain greedy tokens while its drafts are accepted."""
from __future__ import annotations

import pytest

from verispec.checkpoints import CheckpointNotInstalled
from verispec.model_files import resolve_model_path
from verispec.registry import Registry
from verispec_dflash.hooks import BUNDLED_DRAFTER

ALIAS = BUNDLED_DRAFTER[0]
TRUNK = "smollm2-135m-instruct"
# not a benchmark scenario: a copy task the drafter's domain covers
PROMPT = [{"role": "user", "content": "Here is a function:\n\n```python\ndef area(width, height):\n"
                                      "    \"\"\"Rectangle area.\"\"\"\n    if width < 0 or height < 0:\n"
                                      "        raise ValueError('negative side')\n    return width * height\n```\n\n"
                                      "Repeat this code exactly:\n\n```python\n"}]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))


def test_alias_resolves_to_the_bundled_drafter():
    from verispec_dflash.loader import read_config

    path = resolve_model_path(ALIAS, Registry.discover(), flag="--draft-model")  # sha256-checked on the way
    assert path.endswith(BUNDLED_DRAFTER[1].rsplit("/", 1)[1])
    gguf, config = read_config(path)
    assert gguf.architecture == "dflash" and config.generation == 1
    assert config.hidden_size == 576 and config.block_size >= 4


def test_generate_with_the_alias_streams_plain_greedy():
    import verispec

    pytest.importorskip("verispec_llama", reason="SmolLM2's family: pip install -e models/llama")

    try:
        plain = verispec.load(TRUNK, threads=1, enabled=False)
    except CheckpointNotInstalled as exc:
        pytest.skip(str(exc))
    want = [e.token for e in plain.generate(PROMPT, max_tokens=40, ignore_eos=True)]
    engine = verispec.load(TRUNK, threads=1, spec_type="block", draft_model=ALIAS, adaptive=False,
                           min_draft_prob=0.0)  # draft every step: the test is about the stream
    generation = engine.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert [e.token for e in generation] == want
    spec = generation.result.spec
    assert generation.result.speculator == "dflash"
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
