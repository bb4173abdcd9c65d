"""Every path that declines speculation when a Nemotron-H trunk refuses it.

The measured verdict is that the family speculates (README.md "Verdict"), so these tests force
a refusal by setting `speculation_refusal` on the trunk class, as a trunk whose verify rows
differ from its decode rows would declare it. Paths: the registry's create (auto declines,
an explicit type raises), the engine (`--spec-type auto` logs the reason once and decodes
plainly; an explicit type is an error; a `--draft-model` is never loaded), and the CLI in a
subprocess (`--spec` prints one warning and decodes plainly; `--spec-type ngram` exits
non-zero with the reason).
"""
import json
import subprocess
import sys

import pytest
from verispec import api
from verispec.registry import Registry
from verispec.speculator_choice import SpeculationUnavailable, choose_speculator
from verispec_nemotron.loader import load
from verispec_nemotron.modeling_nemotron_h import NemotronHForCausalLM

pytest.importorskip("transformers")

REASON = "k-row verify differs from one-row decodes by 3e-2 (forced for a test)"
PROMPT = "the cat sat on the mat. the cat sat on the mat."


@pytest.fixture
def refusing(monkeypatch):
    monkeypatch.setattr(NemotronHForCausalLM, "speculation_refusal", REASON)


@pytest.fixture(scope="module")
def path(tiny_fixture):
    return tiny_fixture("dense")[1]


def test_registry_auto_declines_and_an_explicit_type_raises(path, refusing):
    registry = Registry.discover()
    trunk = load(path, use_cache=False, tokenizer=False)
    choice = choose_speculator(registry, "auto", trunk, max_draft_tokens=8)
    assert choice.speculator is None and choice.declines
    assert all(REASON in why for why in choice.declines.values())
    with pytest.raises(SpeculationUnavailable, match="3e-2"):
        choose_speculator(registry, "ngram", trunk, max_draft_tokens=8)


def test_engine_auto_logs_the_reason_once_and_decodes_plainly(path, refusing, caplog):
    with caplog.at_level("WARNING", logger="verispec"):
        engine = api.load(path, spec_type="auto")
        first = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
        list(first)
        list(engine.generate(PROMPT + " again", max_tokens=4, ignore_eos=True))
    # only the engine's own lines: discovery may warn about an unrelated plugin that fails to import
    warnings = [r.getMessage() for r in caplog.records if "speculation" in r.getMessage()]
    assert warnings == [f"speculation off: {REASON}"]
    assert engine.speculator is None
    assert first.result.speculator is None and first.result.spec.num_draft_tokens == 0
    plain = api.load(path, enabled=False).generate(PROMPT, max_tokens=12, ignore_eos=True)
    list(plain)
    assert first.result.tokens == plain.result.tokens


def test_engine_explicit_type_is_an_error_and_a_draft_model_is_never_loaded(path, refusing, tmp_path):
    with pytest.raises(SpeculationUnavailable, match="the trunk refuses speculation: k-row verify"):
        api.load(path, spec_type="ngram")
    not_a_drafter = tmp_path / "drafter.gguf"
    not_a_drafter.write_bytes(b"not a GGUF")  # opening it would raise NotGGUF
    engine = api.load(path, spec_type="auto", draft_model=str(not_a_drafter))
    assert engine.speculator is None
    with pytest.raises(SpeculationUnavailable, match="refuses speculation"):
        api.load(path, spec_type="draft-head", draft_model=str(not_a_drafter))


def _cli(path, *flags):
    """`verispec generate` in a subprocess whose Nemotron-H trunk class refuses speculation."""
    code = ("import sys; from verispec_nemotron.modeling_nemotron_h import NemotronHForCausalLM as M; "
            f"M.speculation_refusal = {REASON!r}; import verispec.cli.main as cli; sys.exit(cli.main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "generate", "--model", path, "--max-tokens", "8", "--threads", "1",
           *flags, PROMPT]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_cli_spec_warns_once_and_an_explicit_type_exits_non_zero(path):
    out = _cli(path, "--spec", "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("speculation off") == 1 and REASON in out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["speculator"] is None and result["drafted"] == 0 and len(result["tokens"]) == 8
    out = _cli(path, "--spec-type", "ngram")
    assert out.returncode != 0
    assert "--spec-type ngram cannot be served" in out.stderr and REASON in out.stderr
    assert "Traceback" not in out.stderr
