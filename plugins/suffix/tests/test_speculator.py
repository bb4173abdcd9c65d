"""SuffixSpeculator: drafts against the brute-force rule (suffix_brute.propose), the guards, how the
engine-wide index learns finished sequences, and registration."""
import gc
from importlib.metadata import entry_points

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import suffix_brute as brute
from verispec.registry import Registry
from verispec.seams import DraftContext
from verispec.specs import resolve
from verispec_suffix import hooks
from verispec_suffix.hooks import SPEC
from verispec_suffix.speculator import SuffixSpeculator, SuffixState, create

A, B, C, D, X, EOS = 1, 2, 3, 4, 9, 99


def ctx(last, pos, *, k=8, pmin=0.0, stops=()):
    return DraftContext(last_token=last, pos=pos, max_draft_tokens=k, min_draft_prob=pmin,
                        stop_token_ids=frozenset(stops))


def seeded(speculator, history):
    state = speculator.new_state()
    speculator.commit(state, history, None, 0)
    return state


@settings(max_examples=60, deadline=None)
@given(stream=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       shared=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=4),
       chunk_sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       k=st.integers(0, 6), max_depth=st.integers(2, 8), factor=st.sampled_from([0.5, 1.0, 2.0]),
       stops=st.sets(st.integers(0, 4), max_size=1))
def test_drafts_follow_the_rule_by_linear_scan(stream, shared, chunk_sizes, k, max_depth, factor, stops):
    """Committed in chunks with the shared index filled first: before each chunk, every pmin's draft
    is the brute-force rule's over the sequence so far and the shared documents."""
    speculator = SuffixSpeculator(max_depth=max_depth, max_spec_factor=factor, shared_tokens=10**6)
    for d in shared:
        speculator.shared.add(d)
    state = speculator.new_state()
    pos, i = 0, 0
    while pos < len(stream):
        for pmin in (0.0, 0.3, 0.7):
            got = speculator.propose(state, ctx(stream[pos], pos, k=k, pmin=pmin, stops=stops))
            want = brute.propose(stream[:pos], stream[pos], shared, max_depth=max_depth, max_tokens=k,
                                 min_prob=pmin, factor=factor, stops=stops)
            assert got == want, (pmin, stream[:pos], stream[pos])
        size = chunk_sizes[i % len(chunk_sizes)]
        speculator.commit(state, stream[pos:pos + size], None, pos)
        pos, i = pos + size, i + 1


@settings(max_examples=40, deadline=None)
@given(first=st.lists(st.integers(0, 3), min_size=1, max_size=20), later=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=3))
def test_a_cursor_kept_across_a_change_of_the_shared_index_is_found_again(first, later, docs):
    """Documents folded (and evicted) while a sequence runs: its next draft is the rule's over the shared index as it is now."""
    speculator = SuffixSpeculator(max_depth=5, shared_tokens=12)
    speculator.shared.add([0, 1, 2, 3] * 2)
    state = seeded(speculator, first)
    speculator.propose(state, ctx(later[0], len(first)))  # the cursor follows the index as it was
    for d in docs:
        speculator.shared.add(d)
    speculator.commit(state, later, None, len(first))
    history = first + later
    kept = list(speculator.shared.documents)
    for last in range(4):
        assert speculator.propose(state, ctx(last, len(history), k=3)) == brute.propose(
            history, last, kept, max_depth=5, max_tokens=3, min_prob=0.0)


def test_worked_example_from_the_docstring():
    speculator = SuffixSpeculator()
    draft = speculator.propose(seeded(speculator, [A, B, C, A, B, D, A, B]), ctx(C, 8, pmin=0.1))
    assert draft == [A, B, D]
    assert draft.probs == pytest.approx([0.75] * 3)  # each 1/1 along the path, times |w| / (|w| + 1) = 3/4


def test_each_draft_is_scored_given_the_drafts_before_it():
    # as below: after [A], B twice, C once; after [A B], D once, X once; the match w = [A]
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    draft = speculator.propose(seeded(speculator, [A, B, X, A, B, D, A, C, 7]), ctx(A, 9, pmin=0.0, k=2))
    assert draft == [B, D] and draft.probs == pytest.approx([0.5 * 2 / 3, 0.5 * 1 / 2])


def test_alpha_caps_the_draft_at_match_length_times_factor():
    history = [X, A, B, C, D, A, B, C, D, X]
    speculator = SuffixSpeculator()  # [X D] occurs nowhere earlier, [D] twice: 1 token; A and X tie, A is lower
    assert speculator.propose(seeded(speculator, history), ctx(D, 10)) == [A]
    speculator = SuffixSpeculator(max_spec_factor=3.0)
    assert speculator.propose(seeded(speculator, history), ctx(D, 10)) == [A, B, C]


def test_pmin_cuts_unlikely_tokens():
    # after [A]: B twice, C once: P(B) = 2/3; after [A B]: D once, X once (D is lower): P(B D) = 2/3 * 1/2
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    state = seeded(speculator, [A, B, X, A, B, D, A, C, 7])
    assert speculator.propose(state, ctx(A, 9, pmin=0.0, k=2)) == [B, D]
    assert speculator.propose(state, ctx(A, 9, pmin=0.5, k=2)) == [B]
    assert speculator.propose(state, ctx(A, 9, pmin=0.7, k=2)) == []


def test_the_shared_index_wins_with_a_better_score_and_the_sequence_on_a_tie():
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    for _ in range(3):
        speculator.shared.add([A, B, C, D])
    state = seeded(speculator, [X, A, B, X])  # own: [A B] → X (1/1, one token before its end)
    assert speculator.propose(state, ctx(B, 4, k=3)) == [C, D]  # shared: [A B] → C D (3/3, 3/3); score 2 > 1
    state = seeded(speculator, [A, B, C, D, X, A])  # own: [A B] → C D X A (score 4 > 2)
    assert speculator.propose(state, ctx(B, 6, k=4)) == [C, D, X, A]
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    speculator.shared.add([A, B, D])
    state = seeded(speculator, [A, B, C, X])
    assert speculator.propose(state, ctx(B, 4, k=1)) == [C]  # 1 = 1: the sequence's own


def test_guards_stop_tokens_window_and_gaps():
    speculator = SuffixSpeculator()
    state = seeded(speculator, [A, B, EOS, C, A])
    assert speculator.propose(state, ctx(B, 5, stops={EOS})) == [EOS]  # the stop is drafted, nothing after
    assert speculator.propose(state, ctx(EOS, 5, stops={EOS})) == []  # a pending stop: no draft
    assert speculator.propose(state, ctx(B, 5, k=0)) == []
    assert speculator.propose(state, ctx(B, 6)) == []  # ctx.pos out of step
    speculator.commit(state, [B], None, 9)  # a gap: silent from now on
    speculator.commit(state, [B], None, 5)
    assert state.is_silent and speculator.propose(state, ctx(B, 5)) == []


def test_the_step_bound_is_ctx_max_draft_tokens_not_the_speculators_own():
    speculator = SuffixSpeculator(max_draft_tokens=2, max_spec_factor=8.0)
    state = seeded(speculator, [A, B, C, D, X] * 3 + [A])
    assert speculator.propose(state, ctx(B, 16, k=5)) == [C, D, X, A, B]


def test_a_dropped_state_leaves_its_output_to_the_next_sequence():
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    state = speculator.new_state()
    speculator.commit(state, [X, X, X], None, 0)  # the prompt: the first commit
    speculator.commit(state, [A, B], None, 3)
    speculator.commit(state, [C, D], None, 5)
    other = seeded(speculator, [A])
    assert speculator.propose(other, ctx(B, 1)) == []  # while the first runs, nothing is shared
    del state
    gc.collect()
    assert speculator.propose(other, ctx(B, 1, k=2)) == []  # queued: propose folds nothing (it is timed)
    speculator.prepare(other, ctx(B, 1, k=2))  # the untimed catch-up before a draft folds it
    assert speculator.propose(other, ctx(B, 1, k=2)) == [C, D]
    assert list(speculator.shared.documents) == [[A, B, C, D]]  # the output only
    speculator.finish(other)
    assert list(speculator.shared.documents) == [[A, B, C, D]]  # `other` had no output
    del other
    gc.collect()
    speculator.new_state()
    assert list(speculator.shared.documents) == [[A, B, C, D]]  # finish folded it once


def test_index_prompts_and_an_engine_wide_index_turned_off():
    speculator = SuffixSpeculator(index_prompts=True)
    speculator.finish(seeded(speculator, [X, A, B]))
    assert list(speculator.shared.documents) == [[X, A, B]]
    speculator = SuffixSpeculator(shared_tokens=0)
    speculator.finish(seeded(speculator, [X, A, B]))
    state = seeded(speculator, [C])
    speculator.commit(state, [A], None, 1)
    assert speculator.shared.num_tokens == 0 and speculator.propose(state, ctx(B, 2)) == []


def test_the_factory_reads_its_environment(monkeypatch):
    monkeypatch.setenv("VERISPEC_SUFFIX_SHARED_TOKENS", "123")
    monkeypatch.setenv("VERISPEC_SUFFIX_PROMPTS", "1")
    speculator = create(None, max_draft_tokens=5, min_draft_prob=None)
    assert (speculator.shared.max_tokens, speculator.index_prompts) == (123, True)
    assert speculator.min_draft_prob == SPEC.default_min_draft_prob == 0.1
    assert isinstance(speculator.new_state(), SuffixState)


def test_registered_through_the_verispec_entry_point():
    (ep,) = [ep for ep in entry_points(group="verispec") if ep.name == "suffix"]
    assert ep.value == "verispec_suffix.hooks"
    entry = Registry.discover().speculators["suffix"]
    assert entry.spec is hooks.SPEC and entry.distribution == "verispec-suffix"
    spec = entry.spec
    assert (spec.requires_draft_head, spec.needs_hidden_state, spec.can_arm_after_prefix_reuse) == (False, False, True)
    assert resolve(spec.factory) is create


def test_close_forgets_the_engine_wide_index():
    speculator = SuffixSpeculator(max_spec_factor=4.0)
    speculator.shared.add([A, B, C, D, X])
    state = seeded(speculator, [X, A])
    assert speculator.propose(state, ctx(B, 2, k=2)) == [C, D]
    speculator.close()
    speculator.commit(state, [B], None, 2)  # a cursor into the old index is never followed into the new one
    assert speculator.propose(state, ctx(C, 3, k=2)) == []
