"""The speculator suite fails what it must: a drafter that never drafts (keyed on a token the toy
never emits, or reading ctx.hidden_prev without declaring needs_hidden_state), hidden rows that
do not arrive; `never_drafts_here` opts out; `HeadSpeculatorConformance` runs a head-reading
drafter over a GGUF-loaded trunk; `assert_plugin_loads` catches a typo'd reference."""
import types

import pytest

from verispec import hookimpl
from verispec.seams import Speculator
from verispec.specs import SpeculatorSpec
from verispec.testing.registration import assert_plugin_loads
from verispec.testing.speculator_conformance import HeadSpeculatorConformance, SpeculatorConformance
from verispec.testing.toy import EchoSpeculator, ToyTrunk

NEWLINE = 10  # a token id the toy trunk's greedy stream from the suite's prompt never reaches


def spec(name, **declarations):
    return SpeculatorSpec(name=name, summary=name, factory="json:dumps", **declarations)


class NewlineKeyed(Speculator):
    """Copies the rest of the line after the last newline: the toy never emits one, so it never drafts."""

    def new_state(self):
        return []

    def propose(self, history, ctx):
        if NEWLINE not in history:
            return []
        return history[history.index(NEWLINE) + 1:][:ctx.max_draft_tokens]

    def commit(self, history, tokens, hidden_rows, start_pos):
        history[start_pos:] = tokens


class UndeclaredHiddenReader(Speculator):
    """Reads ctx.hidden_prev without declaring needs_hidden_state: it is always None."""

    def propose(self, state, ctx):
        if ctx.hidden_prev is None:
            return []
        return [int(ctx.trunk.logits(ctx.hidden_prev[None]).argmax())][:ctx.max_draft_tokens]

    def commit(self, state, tokens, hidden_rows, start_pos):
        pass


class Suite(SpeculatorConformance):
    pass


class HeadSuite(HeadSpeculatorConformance):
    pass


@pytest.mark.parametrize("make, hint", [
    (lambda: NewlineKeyed(spec("newline")), "unless its SpeculatorSpec declares needs_hidden_state=True"),
    (lambda: UndeclaredHiddenReader(spec("reader")), "hidden_prev and commit's hidden_rows are None"),
])
def test_the_suite_fails_a_drafter_that_never_drafts(make, hint):
    suite = Suite()
    with pytest.raises(AssertionError, match="proposed no token in") as info:
        suite.test_it_drafts(ToyTrunk(vocab_size=16, recurrent=True), make)
    assert hint in str(info.value) and "never_drafts_here" in str(info.value)
    # every other case of the suite passes it: that is why the drafting check exists
    suite.test_stream_equals_plain_greedy(ToyTrunk(vocab_size=16, recurrent=True), make)


def test_a_drafter_that_drafts_passes_and_the_opt_out_skips_with_its_reason():
    Suite().test_it_drafts(ToyTrunk(vocab_size=16, recurrent=True), lambda: EchoSpeculator(spec("echo")))

    class OptedOut(SpeculatorConformance):
        never_drafts_here = "it copies lines and the toy emits no newline"

    with pytest.raises(pytest.skip.Exception, match="the toy emits no newline"):
        OptedOut().test_it_drafts(ToyTrunk(vocab_size=16), lambda: NewlineKeyed(spec("newline")))


class NextRowHead(Speculator):
    """A head-reading drafter: the LM head over ctx.hidden_prev's row shifted by the embedding of
    the pending token (a guess, often wrong, always checked)."""

    def propose(self, state, ctx):
        if ctx.last_token in ctx.stop_token_ids:
            return []
        view = ctx.trunk
        import torch

        row = ctx.hidden_prev + view.embed(torch.tensor([ctx.last_token]))[0]
        return [int(view.logits(row[None]).argmax())][:ctx.max_draft_tokens]

    def commit(self, state, tokens, hidden_rows, start_pos):
        assert hidden_rows is not None and hidden_rows.shape[0] == len(tokens)


def test_hidden_rows_that_do_not_arrive_fail_the_suite(tmp_path):
    """A drafter declaring needs_hidden_state gets its rows; one that asks for the rows of taps
    and is handed other widths would fail the shape check (here: a wrong declared width)."""
    head_suite = HeadSuite()
    trunk = ToyTrunk(vocab_size=16, recurrent=True)
    make = lambda: NextRowHead(spec("head", needs_hidden_state=True))  # noqa: E731
    head_suite.test_hidden_rows_arrive_when_declared(trunk, make)

    class NarrowTrunk(ToyTrunk):  # tells the suite its taps are narrower than the rows it hands out
        def view(self):
            view = super().view()
            return types.SimpleNamespace(tap_feature_size=lambda taps: 8, logits=view.logits, embed=view.embed)

    with pytest.raises(AssertionError, match=r"hidden_prev \(16,\), expected \(8,\)"):
        head_suite.test_hidden_rows_arrive_when_declared(NarrowTrunk(vocab_size=16), make)


class TestHeadSuiteOnAHeadReader(HeadSpeculatorConformance):
    """The whole head suite over the GGUF-loaded toy trunk, with a drafter reading hidden rows."""

    @pytest.fixture
    def make_speculator(self, toy_trunk):
        return lambda: NextRowHead(spec("head", needs_hidden_state=True))


def test_assert_plugin_loads_catches_a_typo_and_passes_a_good_plugin():
    def hooks(factory):
        @hookimpl
        def register_speculators(register):
            register(SpeculatorSpec(name="mine", summary="mine", factory=factory))
        return types.SimpleNamespace(register_speculators=register_speculators)

    registry = assert_plugin_loads(hooks("verispec.testing.toy:EchoSpeculator"))
    assert list(registry.speculators) == ["mine"]
    with pytest.raises(AssertionError, match="factory 'verispec.testing.toy:EchoSpeculatr' does not import"):
        assert_plugin_loads(hooks("verispec.testing.toy:EchoSpeculatr"))
    with pytest.raises(AssertionError, match="registers nothing"):
        assert_plugin_loads(types.SimpleNamespace())
