"""line-copy's tests: the plugin loads, the speculator suite on the toy trunk, the drafting rule,
the decline, and one engine run whose output equals plain decoding."""
import pytest

from verispec.testing import SpeculatorConformance, assert_plugin_loads
from line_copy.hooks import SPEC
from line_copy.speculator import LineCopy, create

#: the toy trunk has no tokenizer; its greedy stream from the suite's prompt cycles 5, 0: 0 ends its lines
NEWLINE = 0


def test_the_plugin_loads():
    registry = assert_plugin_loads("line_copy.hooks")
    assert registry.speculators["line-copy"].spec is SPEC


class TestLineCopyConformance(SpeculatorConformance):
    @pytest.fixture
    def make_speculator(self):
        return lambda: LineCopy(SPEC, newline_ids=frozenset({NEWLINE}), max_draft_tokens=8)


def propose(history, last_token, k=8, stop=frozenset()):
    from verispec.seams import DraftContext

    drafter = LineCopy(SPEC, newline_ids=frozenset({NEWLINE}))
    state = drafter.new_state()
    drafter.commit(state, history, None, 0)
    return drafter.propose(state, DraftContext(last_token=last_token, pos=len(history), max_draft_tokens=k,
                                               min_draft_prob=0.0, stop_token_ids=stop))


def test_copies_the_rest_of_the_line_that_began_the_same_way():
    lines = [7, 8, 9, NEWLINE, 7, 5, 6, NEWLINE, 4, NEWLINE]
    assert propose(lines, 7) == [5, 6, NEWLINE]  # the most recent line starting with 7
    assert propose(lines + [7], 8) == [9, NEWLINE]  # "7 8" matches only the first
    assert propose(lines, 7, k=2) == [5, 6]  # at most ctx.max_draft_tokens
    assert propose(lines, 7, stop=frozenset({6})) == [5, 6]  # a draft ends at a stop id
    assert propose(lines, 7, stop=frozenset({7})) == []  # nothing after a pending stop
    assert propose(lines, 2) == [] and propose(lines, NEWLINE) == []


def test_declines_with_a_reason_without_a_tokenizer():
    from verispec.testing import ToyTrunk

    decline = create(ToyTrunk(vocab_size=16), spec=SPEC, max_draft_tokens=8, min_draft_prob=0.0, draft_head=None)
    assert decline.reason == "line-copy needs the trunk's tokenizer to find its newline token"


def test_an_engine_run_equals_plain_decoding(tmp_path):
    """Through the engine and registry, as `verispec generate --spec-type line-copy` runs it."""
    import verispec
    from verispec.registry import Registry
    from verispec.testing import toy_plugin
    from verispec.testing.toy import write_toy_gguf

    import line_copy.hooks

    registry = Registry.from_plugins({"toy": toy_plugin, "line-copy": line_copy.hooks})
    engine = verispec.load(write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110), registry=registry,
                           spec_type="line-copy", adaptive=False)
    prompt = "one fish\ntwo fish\nred fish\nblue fish\none fish\ntwo fish\nred fish\nblue fish\none"
    spec = engine.generate(prompt, max_tokens=48, ignore_eos=True)
    for _ in spec:
        pass
    plain = engine.generate(prompt, max_tokens=48, ignore_eos=True, speculate=False)
    for _ in plain:
        pass
    assert spec.result.speculator == "line-copy" and spec.result.tokens == plain.result.tokens
