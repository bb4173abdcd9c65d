"""NGramSpeculator: the index against a linear-scan oracle, the guards, and its registration."""
import math
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.seams import DraftContext, Speculator
from verispec.specs import SpeculatorSpec, resolve
from verispec_ngram import hooks
from verispec_ngram.speculator import NGramSpeculator, create

A, B, C, D, X, EOS = 1, 2, 3, 4, 9, 99


def ctx(last, pos, *, window=8, pmin=0.0, stops=()):
    return DraftContext(last_token=last, pos=pos, draft_window=window, min_draft_prob=pmin,
                        stop_token_ids=frozenset(stops))


def seeded(history, **kwargs):
    spec = NGramSpeculator(**kwargs)
    spec.commit(history, None, 0)
    return spec


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
       max_draft_tokens=st.integers(1, 6), window=st.integers(0, 7),
       stops=st.sets(st.integers(0, 4), max_size=1))
def test_index_matches_linear_scan(stream, chunk_sizes, max_draft_tokens, window, stops):
    # Commit the stream in chunks; before each chunk, the next token is the pending one.
    for min_order, max_order in ORDERS:
        spec = NGramSpeculator(max_draft_tokens=max_draft_tokens, min_order=min_order, max_order=max_order)
        pos, k = 0, 0
        while pos < len(stream):
            for pmin in PMINS:
                got = spec.propose(ctx(stream[pos], pos, window=window, pmin=pmin, stops=stops))
                want = oracle(stream[:pos], stream[pos], num_draft=min(max_draft_tokens, window),
                              min_order=min_order, max_order=max_order, pmin=pmin, stops=stops)
                assert got == want, (min_order, max_order, pmin, stream[:pos], stream[pos])
            size = chunk_sizes[k % len(chunk_sizes)]
            spec.commit(stream[pos:pos + size], None, pos)
            pos, k = pos + size, k + 1


def test_worked_examples_from_the_docstring():
    assert seeded([A, B, C, D, A, B]).propose(ctx(C, 6, window=3)) == [D, A, B]
    assert seeded([X, A, A, A]).propose(ctx(A, 4, window=3)) == [A, A, A]


def test_longest_order_then_latest_occurrence_wins():
    # [B, C] last followed by X (order 2) beats [C] last followed by D (order 1).
    spec = seeded([B, C, X, C, D, B])
    assert spec.propose(ctx(C, 6, window=1)) == [X]
    # Two occurrences of the same order: the later one's continuation.
    spec = seeded([A, B, C, A, B, D, A])
    assert spec.propose(ctx(B, 7, window=1)) == [D]


def test_self_overlapping_repeat_fills_the_window():
    spec = seeded([X, A, A, A], max_draft_tokens=5)
    assert spec.propose(ctx(A, 4)) == [A] * 5
    # Period 2 running into the pending token: a b a b | a -> b a b a ...
    spec = seeded([A, B, A, B], max_draft_tokens=5)
    assert spec.propose(ctx(A, 4)) == [B, A, B, A, B]


def test_window_caps_and_max_draft_tokens_caps():
    history = [A, B, C, D, X, C, A]
    assert seeded(history, max_draft_tokens=8).propose(ctx(B, 7, window=2)) == [C, D]
    assert seeded(history, max_draft_tokens=3).propose(ctx(B, 7, window=8)) == [C, D, X]
    assert seeded(history, max_draft_tokens=3).propose(ctx(B, 7, window=0)) == []


@pytest.mark.parametrize("pmin, required", [(0.0, 1), (0.1, 1), (1 / 6, 2), (0.3, 2), (0.5, 3),
                                            (0.8, 3), (5 / 6, 4), (1.0, 4), (-1.0, 1), (2.0, 4)])
def test_pmin_maps_linearly_onto_required_order(pmin, required):
    assert NGramSpeculator().required_order(pmin) == required


def test_pmin_gates_short_matches():
    spec = seeded([X, A, B, C, D, C])  # pending D: [C, D] (order 2) ends at 4; [D, C, D] nowhere
    assert spec.propose(ctx(D, 6, pmin=0.3, window=1)) == [C]
    assert spec.propose(ctx(D, 6, pmin=0.5, window=1)) == []


def test_stop_token_ends_the_draft_inclusively():
    spec = seeded([A, B, EOS, C, D, A])
    assert spec.propose(ctx(B, 6, stops={EOS})) == [EOS]
    assert spec.propose(ctx(B, 6, window=3)) == [EOS, C, D]  # not a stop for this request


def test_no_draft_after_a_stop_token():
    spec = seeded([EOS, A, EOS, A])
    assert spec.propose(ctx(EOS, 4, stops={EOS})) == []
    assert spec.propose(ctx(EOS, 4, window=1)) == [A]


def test_gap_makes_it_silent_until_reset_and_reseed(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_NGRAM_DEBUG", "1")
    spec = seeded([A, B, C, A])
    assert spec.propose(ctx(B, 4, window=1)) == [C]
    spec.commit([B, C], None, 7)  # positions 4..6 never reached the drafter
    assert spec.propose(ctx(B, 9, window=1)) == []
    spec.commit([A], None, 4)  # even a commit that looks in step is not trusted now
    assert spec.propose(ctx(B, 4, window=1)) == []
    err = capsys.readouterr().err
    assert "gap: commit at 7 but 4 tokens seen" in err and "silent" in err
    spec.reset()
    spec.commit([A, B, C, A], None, 0)  # what the loop's seed_committed does
    assert spec.propose(ctx(B, 4, window=1)) == [C]


def test_commit_from_zero_without_reset_is_a_gap():
    spec = seeded([A, B, C, A])
    spec.commit([A, B], None, 0)
    assert spec.propose(ctx(C, 6, window=1)) == []


def test_context_position_out_of_step_proposes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_NGRAM_DEBUG", "1")
    spec = seeded([A, B, C, A])
    assert spec.propose(ctx(B, 5, window=1)) == []
    assert "ctx.pos=5 but 4 tokens seen" in capsys.readouterr().err
    assert spec.propose(ctx(B, 4, window=1)) == [C]  # not sticky: the history itself is fine


def test_debug_is_quiet_by_default(monkeypatch, capsys):
    monkeypatch.delenv("VERISPEC_NGRAM_DEBUG", raising=False)
    spec = seeded([A, B])
    spec.commit([C], None, 5)
    assert spec.propose(ctx(A, 2)) == []
    assert capsys.readouterr().err == ""


def test_arms_after_a_reused_prefix():
    # A second chat turn: the trunk already holds a long prefix; the loop resets and seeds it at once.
    prefix = [(7 * i) % 50 + 10 for i in range(3000)] + [A, B, C, D]
    spec = seeded([X, X, X])
    spec.reset()
    spec.commit(prefix, None, 0)
    spec.commit([A, B], None, len(prefix))  # then decoding goes on one step at a time
    assert spec.propose(ctx(C, len(prefix) + 2, window=2)) == [D, A]
    assert NGramSpeculator.can_arm_after_prefix_reuse is True


def test_chunked_commit_equals_one_commit():
    history = [A, B, C, A, B, D, A, B, C, C, A]
    whole = seeded(history)
    chunked = NGramSpeculator()
    for start in range(0, len(history), 3):
        chunked.commit(history[start:start + 3], None, start)
    for last in (A, B, C, D):
        assert chunked.propose(ctx(last, len(history))) == whole.propose(ctx(last, len(history)))


def test_commit_accepts_anything_with_tolist():
    class Ids(list):  # stands in for a torch.LongTensor without importing torch
        def tolist(self):
            return list(self)

    spec = NGramSpeculator()
    spec.commit(Ids([A, B, C, A]), None, 0)
    assert spec.propose(ctx(B, 4, window=1)) == [C]


def test_largest_ids_keep_distinct_keys():
    big = 2**32 - 1  # the largest id a 32-bit packed key holds exactly
    spec = seeded([5, big, 7, 6, big, 8, 5])
    assert spec.propose(ctx(big, 7, window=1)) == [7]  # [5, big] matched, not [6, big] or [big]


def test_out_of_range_ids_collide_but_never_draft_wrongly():
    # Keys pack 32 bits per id, so [1, 0] and [0, 2**32] share a packed key. The latest entry
    # under it is [0, 2**32] at 4, whose continuation B would be a wrong draft; the token check
    # rejects it and order 1 ([0], latest at 3) answers instead.
    spec = seeded([1, 0, A, 0, 2**32, B, 1])
    assert spec.propose(ctx(0, 7, window=1)) == [2**32]


def test_bad_orders_are_rejected():
    with pytest.raises(ValueError, match="min_order=3, max_order=2"):
        NGramSpeculator(min_order=3, max_order=2)


def test_declarations_and_factory():
    spec = create(object(), max_draft_tokens=5, min_draft_prob=None, draft_head=None)
    assert isinstance(spec, Speculator) and isinstance(spec, NGramSpeculator)
    assert (spec.name, spec.max_draft_tokens, spec.min_draft_prob) == ("ngram", 5, 0.0)
    assert spec.needs_hidden_state is False and spec.can_arm_after_prefix_reuse is True
    assert create(None, max_draft_tokens=3, min_draft_prob=0.5, draft_head=None).min_draft_prob == 0.5


def test_close_forgets_the_history():
    spec = seeded([A, B, C, A])
    spec.close()
    assert spec.propose(ctx(B, 0)) == []


def test_scalar_like_last_token_is_read_as_an_int():
    class Scalar(int):  # a numpy/torch scalar stand-in whose `|` with a big int would misbehave
        def __ror__(self, other):
            raise OverflowError("Python int too large to convert")

    assert seeded([A, B, C, A]).propose(ctx(Scalar(B), 4, window=1)) == [C]


def test_hook_registers_a_valid_spec():
    specs = []
    hooks.register_speculators(specs.append)
    (spec,) = specs
    assert isinstance(spec, SpeculatorSpec)
    assert (spec.name, spec.requires_draft_head, spec.needs_hidden_state) == ("ngram", False, False)
    assert (spec.can_arm_after_prefix_reuse, spec.default_min_draft_prob, spec.priority) == (True, 0.0, 10)
    assert resolve(spec.factory) is create
    assert spec.default_min_draft_prob == NGramSpeculator.default_min_draft_prob


def test_entry_point_names_the_hook_module():
    (ep,) = [ep for ep in entry_points(group="verispec") if ep.name == "ngram"]
    assert ep.value == "verispec_ngram.hooks"


def test_plugin_imports_without_torch():
    code = ("import sys, verispec_ngram.hooks, verispec_ngram.speculator; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
