"""NGramSpeculator: the index against a linear-scan oracle, the guards, per-sequence state, registration."""
import math
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.registry import Registry
from verispec.seams import DraftContext, Speculator
from verispec.specs import SpeculatorSpec, resolve
from verispec.speculator_choice import choose_speculator
from verispec_ngram import hooks
from verispec_ngram.hooks import SPEC
from verispec_ngram.speculator import NGramSpeculator, NGramState, create

A, B, C, D, X, EOS = 1, 2, 3, 4, 9, 99


def ctx(last, pos, *, k=8, pmin=0.0, stops=()):
    return DraftContext(last_token=last, pos=pos, max_draft_tokens=k, min_draft_prob=pmin,
                        stop_token_ids=frozenset(stops))


class Drafter:
    """One sequence's view of a speculator: the shared speculator and this sequence's state.

    Keeps the many propose/commit cases short; the seam itself is speculator.commit(state, ...).
    """

    def __init__(self, speculator=None, **kwargs):
        self.speculator = NGramSpeculator(**kwargs) if speculator is None else speculator
        self.state = self.speculator.new_state()

    def commit(self, tokens, hidden_rows, start_pos):
        self.speculator.commit(self.state, tokens, hidden_rows, start_pos)

    def propose(self, c):
        return self.speculator.propose(self.state, c)


def seeded(history, **kwargs):
    drafter = Drafter(**kwargs)
    drafter.commit(history, None, 0)
    return drafter


def oracle(history, last, *, num_draft, min_order, max_order, pmin, stops):
    """The rule by linear scan: longest order first, latest earlier occurrence, overlapping copy."""
    if last in stops or num_draft <= 0:
        return []
    seq = list(history) + [last]
    end = len(history)  # where the pending token sits
    required = min_order + math.floor(pmin * (max_order - min_order) + 0.5)
    for n in range(max_order, required - 1, -1):
        for j in range(end - 1, n - 2, -1):  # occurrences ending before the pending token
            if seq[j - n + 1:j + 1] == seq[end - n + 1:end + 1]:
                draft = []
                for i in range(num_draft):
                    t = (seq + draft)[j + 1 + i]
                    draft.append(t)
                    if t in stops:
                        break
                return draft
    return []


ORDERS = [(lo, hi) for lo in (1, 2, 3) for hi in range(lo, 6)]
PMINS = (0.0, 0.2, 0.5, 0.8, 1.0)


@settings(max_examples=300, deadline=None)
@given(stream=st.lists(st.integers(0, 3), min_size=1, max_size=50),
       chunk_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       k_step=st.integers(0, 7),
       stops=st.sets(st.integers(0, 4), max_size=1))
def test_index_matches_linear_scan(stream, chunk_sizes, k_step, stops):
    # Commit the stream in chunks; before each chunk, the next token is the pending one.
    for min_order, max_order in ORDERS:
        drafter = Drafter(min_order=min_order, max_order=max_order)
        pos, k = 0, 0
        while pos < len(stream):
            for pmin in PMINS:
                got = drafter.propose(ctx(stream[pos], pos, k=k_step, pmin=pmin, stops=stops))
                want = oracle(stream[:pos], stream[pos], num_draft=k_step,
                              min_order=min_order, max_order=max_order, pmin=pmin, stops=stops)
                assert got == want, (min_order, max_order, pmin, stream[:pos], stream[pos])
            size = chunk_sizes[k % len(chunk_sizes)]
            drafter.commit(stream[pos:pos + size], None, pos)
            pos, k = pos + size, k + 1


@settings(max_examples=200, deadline=None)
@given(streams=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=2, max_size=3),
       turns=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8)), min_size=1, max_size=40),
       k=st.integers(1, 6))
def test_interleaved_states_each_match_their_own_linear_scan(streams, turns, k):
    """One speculator, several sequences committed in an arbitrary interleaving: each state
    drafts exactly what the rule gives on its own stream, as if it were alone."""
    speculator = NGramSpeculator(max_draft_tokens=6)
    states = [speculator.new_state() for _ in streams]
    positions = [0] * len(streams)

    def check(i):
        pos, stream = positions[i], streams[i]
        if pos < len(stream):
            for pmin in (0.0, 0.5):
                got = speculator.propose(states[i], ctx(stream[pos], pos, k=k, pmin=pmin))
                assert got == oracle(stream[:pos], stream[pos], num_draft=k, min_order=1, max_order=4,
                                     pmin=pmin, stops=set()), (i, pmin, stream[:pos], stream[pos])

    for who, size in turns + [(i, 10**6) for i in range(len(streams))]:  # then drain every stream
        i = who % len(streams)
        pos = positions[i]
        speculator.commit(states[i], streams[i][pos:pos + size], None, pos)
        positions[i] = min(pos + size, len(streams[i]))
        for j in range(len(streams)):
            check(j)


def test_two_states_of_one_speculator_are_independent(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_NGRAM_DEBUG", "1")
    speculator = NGramSpeculator()
    one, two = speculator.new_state(), speculator.new_state()
    assert isinstance(one, NGramState) and one is not two
    speculator.commit(one, [A, B, C, A], None, 0)
    speculator.commit(two, [A, B, D, A], None, 0)
    assert speculator.propose(one, ctx(B, 4, k=1)) == [C]
    assert speculator.propose(two, ctx(B, 4, k=1)) == [D]

    def proposals(state, pos):
        return [speculator.propose(state, ctx(t, pos, k=w)) for t in (A, B, C, D, X) for w in (1, 3, 8)]

    before = proposals(two, 4)
    speculator.commit(one, [B, X, A], None, 4)  # one grows: its latest [A, B] is now followed by X
    assert speculator.propose(one, ctx(B, 7, k=1)) == [X]
    assert proposals(two, 4) == before
    speculator.commit(one, [A], None, 99)  # a gap silences one ...
    assert speculator.propose(one, ctx(B, 7, k=1)) == []
    assert proposals(two, 4) == before  # ... and only one
    speculator.commit(two, [B], None, 4)  # two still takes commits in step
    assert speculator.propose(two, ctx(D, 5, k=2)) == [A, B]
    assert speculator.propose(one, ctx(B, 7, k=1)) == []  # and that never revives one
    assert speculator.propose(speculator.new_state(), ctx(B, 0)) == []  # a fresh state knows nothing
    assert capsys.readouterr().err.count("gap: commit at") == 1


def test_worked_examples_from_the_docstring():
    assert seeded([A, B, C, D, A, B]).propose(ctx(C, 6, k=3)) == [D, A, B]
    assert seeded([X, A, A, A]).propose(ctx(A, 4, k=3)) == [A, A, A]


def test_longest_order_then_latest_occurrence_wins():
    # [B, C] last followed by X (order 2) beats [C] last followed by D (order 1).
    drafter = seeded([B, C, X, C, D, B])
    assert drafter.propose(ctx(C, 6, k=1)) == [X]
    # Two occurrences of the same order: the later one's continuation.
    drafter = seeded([A, B, C, A, B, D, A])
    assert drafter.propose(ctx(B, 7, k=1)) == [D]


def test_self_overlapping_repeat_fills_k():
    drafter = seeded([X, A, A, A])
    assert drafter.propose(ctx(A, 4, k=5)) == [A] * 5
    # Period 2 running into the pending token: a b a b | a -> b a b a ...
    drafter = seeded([A, B, A, B])
    assert drafter.propose(ctx(A, 4, k=5)) == [B, A, B, A, B]


def test_the_step_bound_caps_the_draft():
    history = [A, B, C, D, X, C, A]
    assert seeded(history).propose(ctx(B, 7, k=2)) == [C, D]
    assert seeded(history).propose(ctx(B, 7, k=3)) == [C, D, X]
    assert seeded(history).propose(ctx(B, 7, k=0)) == []


@pytest.mark.parametrize("pmin, required", [(0.0, 1), (0.1, 1), (1 / 6, 2), (0.3, 2), (0.5, 3),
                                            (0.8, 3), (5 / 6, 4), (1.0, 4), (-1.0, 1), (2.0, 4)])
def test_pmin_maps_linearly_onto_required_order(pmin, required):
    assert NGramSpeculator().required_order(pmin) == required


def test_pmin_gates_short_matches():
    drafter = seeded([X, A, B, C, D, C])  # pending D: [C, D] (order 2) ends at 4; [D, C, D] nowhere
    assert drafter.propose(ctx(D, 6, pmin=0.3, k=1)) == [C]
    assert drafter.propose(ctx(D, 6, pmin=0.5, k=1)) == []


def test_stop_token_ends_the_draft_inclusively():
    drafter = seeded([A, B, EOS, C, D, A])
    assert drafter.propose(ctx(B, 6, stops={EOS})) == [EOS]
    assert drafter.propose(ctx(B, 6, k=3)) == [EOS, C, D]  # not a stop for this request


def test_no_draft_after_a_stop_token():
    drafter = seeded([EOS, A, EOS, A])
    assert drafter.propose(ctx(EOS, 4, stops={EOS})) == []
    assert drafter.propose(ctx(EOS, 4, k=1)) == [A]


def test_gap_makes_the_state_silent_until_a_new_state_is_seeded(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_NGRAM_DEBUG", "1")
    drafter = seeded([A, B, C, A])
    assert drafter.propose(ctx(B, 4, k=1)) == [C]
    drafter.commit([B, C], None, 7)  # positions 4..6 never reached the drafter
    assert drafter.propose(ctx(B, 9, k=1)) == []
    drafter.commit([A], None, 4)  # even a commit that looks in step is not trusted now
    assert drafter.propose(ctx(B, 4, k=1)) == []
    err = capsys.readouterr().err
    assert "gap: commit at 7 but 4 tokens seen" in err and "silent" in err
    silent = drafter.state
    drafter.state = drafter.speculator.new_state()  # what the loop's seed_committed does ...
    drafter.commit([A, B, C, A], None, 0)  # ... then it commits the held tokens from 0
    assert drafter.propose(ctx(B, 4, k=1)) == [C]
    assert drafter.speculator.propose(silent, ctx(B, 4, k=1)) == []  # the old state stays silent


def test_commit_from_zero_without_a_new_state_is_a_gap():
    drafter = seeded([A, B, C, A])
    drafter.commit([A, B], None, 0)
    assert drafter.propose(ctx(C, 6, k=1)) == []


def test_context_position_out_of_step_proposes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_NGRAM_DEBUG", "1")
    drafter = seeded([A, B, C, A])
    assert drafter.propose(ctx(B, 5, k=1)) == []
    assert "ctx.pos=5 but 4 tokens seen" in capsys.readouterr().err
    assert drafter.propose(ctx(B, 4, k=1)) == [C]  # not sticky: the history itself is fine


def test_debug_is_quiet_by_default(monkeypatch, capsys):
    monkeypatch.delenv("VERISPEC_NGRAM_DEBUG", raising=False)
    drafter = seeded([A, B])
    drafter.commit([C], None, 5)
    assert drafter.propose(ctx(A, 2)) == []
    assert capsys.readouterr().err == ""


def test_arms_after_a_reused_prefix():
    # A second chat turn: the trunk already holds a long prefix; the loop seeds a new state with it at once.
    prefix = [(7 * i) % 50 + 10 for i in range(3000)] + [A, B, C, D]
    drafter = seeded([X, X, X])
    drafter.state = drafter.speculator.new_state()
    drafter.commit(prefix, None, 0)
    drafter.commit([A, B], None, len(prefix))  # then decoding goes on one step at a time
    assert drafter.propose(ctx(C, len(prefix) + 2, k=2)) == [D, A]
    assert drafter.speculator.spec.can_arm_after_prefix_reuse is True


def test_chunked_commit_equals_one_commit():
    history = [A, B, C, A, B, D, A, B, C, C, A]
    whole = seeded(history)
    chunked = Drafter()
    for start in range(0, len(history), 3):
        chunked.commit(history[start:start + 3], None, start)
    for last in (A, B, C, D):
        assert chunked.propose(ctx(last, len(history))) == whole.propose(ctx(last, len(history)))


def test_commit_accepts_anything_with_tolist():
    class Ids(list):  # stands in for a torch.LongTensor without importing torch
        def tolist(self):
            return list(self)

    drafter = Drafter()
    drafter.commit(Ids([A, B, C, A]), None, 0)
    assert drafter.propose(ctx(B, 4, k=1)) == [C]


def test_largest_ids_keep_distinct_keys():
    big = 2**32 - 1  # the largest id a 32-bit packed key holds exactly
    drafter = seeded([5, big, 7, 6, big, 8, 5])
    assert drafter.propose(ctx(big, 7, k=1)) == [7]  # [5, big] matched, not [6, big] or [big]


def test_out_of_range_ids_collide_but_never_draft_wrongly():
    # Keys pack 32 bits per id, so [1, 0] and [0, 2**32] share a packed key. The latest entry
    # under it is [0, 2**32] at 4, whose continuation B would be a wrong draft; the token check
    # rejects it and order 1 ([0], latest at 3) answers instead.
    drafter = seeded([1, 0, A, 0, 2**32, B, 1])
    assert drafter.propose(ctx(0, 7, k=1)) == [2**32]


def test_bad_orders_are_rejected():
    with pytest.raises(ValueError, match="min_order=3, max_order=2"):
        NGramSpeculator(min_order=3, max_order=2)


def test_declarations_and_factory():
    speculator = create(object(), spec=SPEC, max_draft_tokens=5, min_draft_prob=None, draft_head=None)
    assert isinstance(speculator, Speculator) and isinstance(speculator, NGramSpeculator)
    assert (speculator.name, speculator.max_draft_tokens, speculator.min_draft_prob) == ("ngram", 5, 0.0)
    assert speculator.spec is SPEC
    assert speculator.spec.needs_hidden_state is False and speculator.spec.can_arm_after_prefix_reuse is True
    assert speculator.spec.requires_draft_head is False and speculator.spec.default_min_draft_prob == 0.0
    assert create(None, spec=SPEC, max_draft_tokens=3, min_draft_prob=0.5).min_draft_prob == 0.5
    assert create(None, max_draft_tokens=3, min_draft_prob=None).spec is SPEC  # the registered one by default
    assert NGramSpeculator().spec is SPEC
    # The declarations live only in the spec: the class carries none of its own.
    for name in ("needs_hidden_state", "can_arm_after_prefix_reuse", "default_min_draft_prob",
                 "requires_draft_head"):
        assert not hasattr(NGramSpeculator, name) and not hasattr(speculator, name), name


def test_registry_builds_it_over_the_registered_spec():
    registry = Registry.from_plugins({"ngram": hooks})
    choice = choose_speculator(registry, "ngram", object(), max_draft_tokens=6)
    assert isinstance(choice.speculator, NGramSpeculator) and choice.speculator.spec is SPEC
    assert (choice.speculator.max_draft_tokens, choice.speculator.min_draft_prob) == (6, 0.0)
    assert choose_speculator(registry, "ngram", object(), max_draft_tokens=6,
                                      min_draft_prob=0.5).speculator.min_draft_prob == 0.5


def test_factory_serves_the_spec_it_is_given():
    # The registry calls factory(trunk, spec=<the registered spec>, ...): name and pmin default follow it.
    other = SpeculatorSpec(name="ngram-strict", summary="n-gram, strict gate",
                           factory="verispec_ngram.speculator:create", default_min_draft_prob=1.0)
    speculator = create(None, spec=other, max_draft_tokens=4, min_draft_prob=None)
    assert (speculator.spec, speculator.name, speculator.min_draft_prob) == (other, "ngram-strict", 1.0)


def test_new_state_starts_empty_and_close_leaves_states_alone():
    drafter = seeded([A, B, C, A])
    fresh = drafter.speculator.new_state()
    assert fresh is not drafter.state and fresh.tokens == [] and not fresh.is_silent
    assert drafter.speculator.propose(fresh, ctx(B, 0)) == []  # a new state has no history
    assert drafter.speculator.propose(fresh, ctx(B, 4)) == []  # nor does it see another's
    drafter.speculator.close()  # a no-op: per-sequence state belongs to the sequence, not the speculator
    assert drafter.propose(ctx(B, 4, k=1)) == [C]


def test_scalar_like_last_token_is_read_as_an_int():
    class Scalar(int):  # a numpy/torch scalar stand-in whose `|` with a big int would misbehave
        def __ror__(self, other):
            raise OverflowError("Python int too large to convert")

    assert seeded([A, B, C, A]).propose(ctx(Scalar(B), 4, k=1)) == [C]


def test_hook_registers_a_valid_spec():
    specs = []
    hooks.register_speculators(specs.append)
    (spec,) = specs
    assert isinstance(spec, SpeculatorSpec)
    assert (spec.name, spec.requires_draft_head, spec.needs_hidden_state) == ("ngram", False, False)
    assert (spec.can_arm_after_prefix_reuse, spec.default_min_draft_prob, spec.priority) == (True, 0.0, 10)
    assert resolve(spec.factory) is create
    assert spec is SPEC  # the one place the declarations live; the speculator reads them from it
    assert NGramSpeculator().min_draft_prob == spec.default_min_draft_prob


def test_entry_point_names_the_hook_module():
    (ep,) = [ep for ep in entry_points(group="verispec") if ep.name == "ngram"]
    assert ep.value == "verispec_ngram.hooks"


def test_plugin_imports_without_torch():
    code = ("import sys, verispec_ngram.hooks, verispec_ngram.speculator; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
