"""tiny-head's tests: the plugin loads, the head suite over a GGUF-loaded toy trunk, a head file
written by make_head and loaded by `--draft-model` (the engine picks tiny-head for it in auto,
output equal to plain decoding), and a file fitted on another model declining with its reason."""
import pytest

from verispec.testing import HeadSpeculatorConformance, assert_plugin_loads
from verispec.testing.toy import load_toy_gguf, write_toy_gguf
from tiny_head.head import load
from tiny_head.hooks import SPEC
from tiny_head.make_head import fit_head, write_head
from tiny_head.speculator import TinyHeadSpeculator

#: what the head is fitted on in these tests: token ids of the toy's vocabulary, repeating.
TRAINING = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 12


def head_file(trunk, path) -> str:
    return write_head(str(path), fit_head(trunk, TRAINING), trunk.vocab_size)


def test_the_plugin_loads():
    registry = assert_plugin_loads("tiny_head.hooks")
    assert registry.draft_files["tiny-head"].spec.speculators == ("tiny-head",)


class TestTinyHeadConformance(HeadSpeculatorConformance):
    """The head suite over the toy GGUF trunk (vocabulary 110, width 32) with a head fitted on it."""

    @pytest.fixture
    def make_speculator(self, toy_trunk, tmp_path):
        head = load(head_file(toy_trunk, tmp_path / "head.gguf"), toy_trunk)
        return lambda: TinyHeadSpeculator(head, SPEC, max_draft_tokens=8, min_draft_prob=0.0)


def test_draft_model_picks_tiny_head_in_auto_and_the_output_is_plain_decodings(tmp_path):
    """What `verispec generate --model toy.gguf --draft-model head.gguf` does: the file's format
    names tiny-head, so auto drives it with tiny-head whatever else is installed."""
    import verispec
    from verispec.registry import Registry
    from verispec.testing import toy_plugin

    import tiny_head.hooks

    model = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110, dim=32)
    head = head_file(load_toy_gguf(model), tmp_path / "head.gguf")
    registry = Registry.from_plugins({"toy": toy_plugin, "tiny-head": tiny_head.hooks})
    engine = verispec.load(model, registry=registry, draft_model=head, adaptive=False, min_draft_prob=0.0)
    assert engine.choice.name == "tiny-head" and engine.choice.unused_drafter is None
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49] * 3
    spec = engine.generate(prompt, max_tokens=32, ignore_eos=True)
    for _ in spec:
        pass
    plain = engine.generate(prompt, max_tokens=32, ignore_eos=True, speculate=False)
    for _ in plain:
        pass
    assert spec.result.tokens == plain.result.tokens
    assert spec.result.speculator == "tiny-head" and spec.result.spec.num_draft_tokens > 0


def test_a_head_fitted_on_another_model_declines_naming_both(tmp_path):
    from verispec.seams import DrafterMismatch

    narrow = load_toy_gguf(write_toy_gguf(tmp_path / "narrow.gguf", vocab_size=110, dim=16))
    wide = load_toy_gguf(write_toy_gguf(tmp_path / "wide.gguf", vocab_size=110, dim=32))
    with pytest.raises(DrafterMismatch, match="width 16 and vocabulary 110; this one has 32 and 110"):
        load(head_file(narrow, tmp_path / "head.gguf"), wide)
