"""The `mtp` speculator over a toy PER_TOKEN head on the core toy trunk (no model package needed).

`ToyNextHead` predicts the trunk's bigram-greedy continuation (LM head over the embedding of
the token) and passes the hidden row through, so the speculator's chaining, gate, stop
handling, per-sequence state and registration are tested without trained weights.
"""
import pytest
import torch
from verispec.registry import Registry
from verispec.seams import DraftContext, DraftHeadKind
from verispec.speculator_choice import SpeculationUnavailable, choose_speculator
from verispec.testing import SpeculatorConformance, ToyTrunk, run_greedy
from verispec_mtp_nextn import hooks
from verispec.draft_gate import top1_gate_prob
from verispec_mtp_nextn.speculator import MtpSpeculator


class ToyNextHead:
    """PER_TOKEN head: logits = LM head(embedding(token)) scaled by `sharpness`; h_out = h_prev."""

    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True
    tap_layers = None

    def __init__(self, view, sharpness: float = 1.0):
        self.view, self.sharpness = view, sharpness
        self.calls: list[tuple[int, int]] = []  # (token, pos) of every draft_step

    def new_state(self):
        return {"seen": 0, "kept": []}

    def draft_step(self, state, token, h_prev, pos):
        assert h_prev is not None and h_prev.shape == (self.view.hidden_size,)
        self.calls.append((token, pos))
        return self.view.logits(self.view.embed(torch.tensor([token])))[0] * self.sharpness, h_prev

    def draft_block(self, state, last_token, h_prev, pos, num_rows=None):
        raise NotImplementedError

    def draft_catch_up(self, state, tokens, h_rows, start_pos):
        state["seen"] = start_pos + len(tokens)

    def keep(self, state, num_rows):
        state["kept"].append(num_rows)


class TestMtpConformance(SpeculatorConformance):
    @pytest.fixture
    def make_speculator(self, toy_trunk):
        return lambda: MtpSpeculator(ToyNextHead(toy_trunk.view()), max_draft_tokens=4, min_draft_prob=0.0)


def _ctx(trunk, speculator, window, *, last_token=3, stop=frozenset(), pmin=None):
    return DraftContext(last_token=last_token, pos=5, max_draft_tokens=window,
                        min_draft_prob=speculator.min_draft_prob if pmin is None else pmin,
                        hidden_prev=torch.zeros(trunk.hidden_size), stop_token_ids=stop)


def test_chains_the_head_at_consecutive_positions():
    trunk = ToyTrunk(vocab_size=16)
    head = ToyNextHead(trunk.view())
    speculator = MtpSpeculator(head, max_draft_tokens=8, min_draft_prob=0.0)
    draft = speculator.propose(speculator.new_state(), _ctx(trunk, speculator, 3))
    assert len(draft) == 3
    assert head.calls == [(3, 5), (draft[0], 6), (draft[1], 7)]  # each step reads the previous draft


def test_gate_is_top1_probability_over_the_top_10_logits():
    logits = torch.tensor([5.0, 1.0, 0.5, 3.0] + [-1.0] * 20)
    top = torch.tensor([5.0, 3.0, 1.0, 0.5] + [-1.0] * 6)
    assert top1_gate_prob(logits) == pytest.approx(float(torch.softmax(top, 0)[0]))
    trunk = ToyTrunk(vocab_size=16)
    speculator = MtpSpeculator(ToyNextHead(trunk.view(), sharpness=0.0), max_draft_tokens=8)  # flat: p = 0.1
    assert speculator.min_draft_prob == hooks.SPEC.default_min_draft_prob == 0.15
    assert speculator.propose(speculator.new_state(), _ctx(trunk, speculator, 4)) == []
    assert len(speculator.propose(speculator.new_state(), _ctx(trunk, speculator, 4, pmin=0.05))) == 4


def test_stops_after_a_drafted_stop_token_and_never_at_a_pending_one():
    trunk = ToyTrunk(vocab_size=16)
    speculator = MtpSpeculator(ToyNextHead(trunk.view()), max_draft_tokens=8, min_draft_prob=0.0)
    free = speculator.propose(speculator.new_state(), _ctx(trunk, speculator, 4))
    ctx = _ctx(trunk, speculator, 4, stop=frozenset({free[1]}))
    stopped = speculator.propose(speculator.new_state(), ctx)
    assert stopped == free[:free.index(free[1]) + 1]
    assert speculator.propose(speculator.new_state(), _ctx(trunk, speculator, 4, stop=frozenset({3}))) == []


def test_commit_and_keep_reach_the_heads_per_sequence_state():
    trunk = ToyTrunk(vocab_size=16)
    head = ToyNextHead(trunk.view())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    plain = run_greedy(trunk, prompt, 24)[0]
    got, ex = run_greedy(trunk, prompt, 24, MtpSpeculator(head, max_draft_tokens=4, min_draft_prob=0.0))
    assert got == plain and ex.stats.num_draft_tokens > 0
    state = ex._state
    assert state["seen"] == ex.seq_len and len(state["kept"]) == ex.stats.num_spec_steps


def test_registry_declines_without_a_draft_head_and_builds_with_one():
    registry = Registry.from_plugins({"mtp": hooks})
    trunk = ToyTrunk(vocab_size=16)
    with pytest.raises(SpeculationUnavailable, match="no draft head"):
        choose_speculator(registry, "mtp", trunk, draft_head=None, max_draft_tokens=4)
    with pytest.raises(SpeculationUnavailable, match="no draft head"):
        choose_speculator(registry, "draft-head", trunk, draft_head=None, max_draft_tokens=4)
    choice = choose_speculator(registry, "draft-head", trunk, draft_head=ToyNextHead(trunk.view()),
                                        max_draft_tokens=4)
    assert isinstance(choice.speculator, MtpSpeculator) and choice.name == "mtp"
    assert choice.speculator.min_draft_prob == 0.15 and choice.speculator.spec.requires_draft_head
