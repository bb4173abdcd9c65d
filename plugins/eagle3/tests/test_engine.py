"""Through the loop and the engine on the tiny llama trunk: every stream equals plain greedy with a
random head (drafts mostly rejected: keep/commit at every depth) and with a perfect head (acceptance
1.0); --spec-type eagle3 / auto / mtp with --draft-model head.gguf; a second turn over a reused
prefix; the speculator conformance suite on the trunk.

The perfect pair: a trunk whose layers write nothing to the residual (attention and FFN output
projections zero) and whose embedding rows share one direction e0 (token COPY's row 3·e0), so its
greedy continuation is COPY forever (verispec.testing.make_copy_model); the head's fc passes the first tap through, its attention and
FFN outputs are zero, so its pre-norm row is that tap (≈ e0) at every step, and its LM head's row
for COPY is e0/|e0|: it drafts COPY with confidence ≈ 1. Degenerate weights, but every pass of the
real code runs (taps, fc, the layer, the KV, keep/commit, d2t, the gate).
"""
from __future__ import annotations

import pytest
import torch
from tiny_eagle3 import TAPS, build_target, head_tensors, write_head
from verispec.testing import (SpeculatorConformance, assert_second_turn_streams_plain, assert_staggered_streams_plain,
                              make_copy_model, run_greedy)
from verispec_eagle3.loader import load
from verispec_eagle3.speculator import Eagle3Speculator

PROMPTS = ([5, 17, 33, 2, 90, 41, 41, 8], [60, 61, 62, 7], [12] * 11 + [99, 3])
COPY_TOKEN = 77


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    tensors, d2t = head_tensors(seed=3)
    return write_head(tmp_path_factory.mktemp("heads") / "random.gguf", tensors, d2t)


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    """(trunk path, head path) of the perfect pair (module docstring)."""
    pytest.importorskip("verispec_llama", reason="the tiny target trunk's family: pip install -e models/llama")
    from tiny_llama import write_fixture

    hf = build_target()
    g = torch.Generator().manual_seed(11)
    e0 = make_copy_model(hf, COPY_TOKEN, generator=g)  # g goes on to draw the head's LM head noise
    directory = tmp_path_factory.mktemp("copy")
    trunk_path = write_fixture(hf, directory / "trunk.gguf")
    tensors, d2t = head_tensors(seed=5)
    d2t = torch.sort(torch.unique(torch.cat([d2t[1:], torch.tensor([COPY_TOKEN])]))).values
    d = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([torch.eye(d), torch.zeros(d, 2 * d)], dim=1)  # g = the first tap
    tensors["blk.0.attn_output.weight"].zero_()
    tensors["blk.0.ffn_down.weight"].zero_()
    tensors["output_norm.weight"].fill_(1.0)
    tensors["output.weight"] = 0.01 * torch.randn(d2t.numel(), d, generator=g)
    tensors["output.weight"][int((d2t == COPY_TOKEN).nonzero())] = e0 / e0.norm()
    return trunk_path, write_head(directory / "head.gguf", tensors, d2t)


def _load_trunk(path, dtype="float32"):
    from verispec_llama.loader import load as load_llama

    return load_llama(path, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "int8", "gguf"])
def test_random_head_streams_equal_plain_greedy(target, random_head, dtype):
    from verispec.weights.quant import Float32Linear, Int8Linear

    trunk = _load_trunk(target[1], dtype)
    head = load(random_head, trunk)
    linear = {"float32": Float32Linear, "int8": Int8Linear, "gguf": Int8Linear}[dtype]  # gguf: float-read -> int8
    assert all(type(m) is linear for m in (head.layer.fc, head.layer.q_proj, head.layer.lm_head))
    speculator = Eagle3Speculator(head, max_draft_tokens=5, min_draft_prob=0.0)
    # staggered: solo speculative steps, batched steps (the head sees batched decode rows), solo again
    assert_staggered_streams_plain(trunk, speculator, PROMPTS, (48, 24, 12), submit_at=(0, 6, 9), max_draft_tokens=5)


def test_qwen2_trunk_serves_the_taps_and_streams_stay_plain(tmp_path, random_head):
    """The other family the binding accepts: a qwen2 trunk (q/k/v biases, NEOX RoPE) serves the
    residuals entering the target layers (transformers' hidden_states[L]) and a random head's
    streams equal plain greedy."""
    from tiny_llama import write_fixture
    from verispec.seams import Segment

    hf = build_target(arch="qwen2", seed=2)
    trunk = _load_trunk(write_fixture(hf, tmp_path / "qwen2.gguf"))
    assert trunk.config.architecture == "qwen2"
    head = load(random_head, trunk)
    seq = trunk.new_sequence()
    got = trunk.forward([Segment(seq, PROMPTS[0], logits="none", hidden=True, tap_layers=head.tap_layers)])[0].hidden
    with torch.no_grad():
        states = hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(got, torch.cat([states[L][0] for L in TAPS], dim=-1), atol=2e-4, rtol=1e-4)
    want = run_greedy(trunk, list(PROMPTS[2]), 24)[0]
    got, ex = run_greedy(trunk, list(PROMPTS[2]), 24, Eagle3Speculator(head, max_draft_tokens=4, min_draft_prob=0.0),
                         max_draft_tokens=4)
    assert got == want and ex.stats.num_draft_tokens > 10


def test_perfect_head_is_accepted_in_full(copy_pair):
    trunk_path, head_path = copy_pair
    trunk = _load_trunk(trunk_path)
    head = load(head_path, trunk)
    n = 1 + 4 * 9  # the prefill's token, then 4 steps of 8 drafts + 1: no step is cut by max_tokens
    plain = run_greedy(trunk, list(PROMPTS[0]), n)[0]
    assert plain == [COPY_TOKEN] * n  # the construction works (else the test below proves nothing)
    speculator = Eagle3Speculator(head, max_draft_tokens=8)  # the default gate (0.15) passes: confidence ≈ 1
    got, ex = run_greedy(trunk, list(PROMPTS[0]), n, speculator, max_draft_tokens=8)
    assert got == plain
    assert ex.stats.num_draft_tokens >= 30 and ex.stats.num_accepted_tokens == ex.stats.num_draft_tokens


@pytest.mark.parametrize("spec_type, picked", [("eagle3", "eagle3"), ("auto", "eagle3"), ("draft-head", "eagle3"),
                                               ("mtp", "mtp")])
def test_draft_model_flag_through_the_engine(target, random_head, spec_type, picked):
    """--spec-type eagle3 --draft-model head.gguf; auto and draft-head pick eagle3 over mtp (priority 22 >
    20); mtp's generic PER_TOKEN chain drives the same head through the seam and stays exact too."""
    import verispec

    if spec_type == "mtp":
        pytest.importorskip("verispec_mtp_nextn", reason="the mtp speculator: pip install -e plugins/mtp_nextn")
    prompt = list(PROMPTS[0])
    plain = verispec.load(target[1], dtype="float32", enabled=False)
    want = [e.token for e in plain.generate(prompt, max_tokens=24, ignore_eos=True)]
    engine = verispec.load(target[1], dtype="float32", spec_type=spec_type, draft_model=random_head,
                           adaptive=False, min_draft_prob=0.0)
    generation = engine.generate(prompt, max_tokens=24, ignore_eos=True)
    assert [e.token for e in generation] == want
    assert generation.result.speculator == picked
    assert generation.result.spec.num_draft_tokens > 0


def test_second_turn_after_prefix_reuse_streams_plain_greedy(target, random_head):
    """can_arm_after_prefix_reuse: the reused rows reach the head without taps (holes in its KV); it
    drafts from the next committed rows on, and the stream stays the plain one."""
    trunk = _load_trunk(target[1])
    speculator = Eagle3Speculator(load(random_head, trunk), max_draft_tokens=4, min_draft_prob=0.0)
    assert_second_turn_streams_plain(trunk, speculator, PROMPTS[0], max_draft_tokens=4)


def test_drafts_stop_at_the_window_and_under_the_gate(copy_pair):
    """K = ctx.max_draft_tokens is the only bound (no ceiling of the speculator's own); a gate above the
    head's confidence stops the chain after its first step."""
    from verispec.seams import DraftContext, Segment

    trunk_path, head_path = copy_pair
    trunk = _load_trunk(trunk_path)
    head = load(head_path, trunk)
    speculator = Eagle3Speculator(head, max_draft_tokens=2)
    seq, state = trunk.new_sequence(), speculator.new_state()
    taps = trunk.forward([Segment(seq, PROMPTS[0], logits="none", hidden=True, tap_layers=TAPS)])[0].hidden
    speculator.commit(state, PROMPTS[0], taps, 0)
    for window in (1, 3, 12):
        ctx = DraftContext(last_token=COPY_TOKEN, pos=len(PROMPTS[0]), max_draft_tokens=window,
                           min_draft_prob=0.15, hidden_prev=taps[-1])
        assert speculator.propose(state, ctx) == [COPY_TOKEN] * window
        speculator.keep(state, 1)
    ctx = DraftContext(last_token=COPY_TOKEN, pos=len(PROMPTS[0]), max_draft_tokens=4, min_draft_prob=1.0,
                       hidden_prev=taps[-1])
    assert speculator.propose(state, ctx) == []


def test_prepare_runs_a_prompts_rows_and_leaves_a_verifys(target, random_head):
    """The prompt's committed rows run in `prepare` (one-off, untimed as drafting); the rows one verify
    commits (at most K + 1) stay for the round's first step; drafts are the same either way."""
    from verispec.seams import DraftContext, Segment

    trunk = target[2]
    head = load(random_head, trunk)
    speculator = Eagle3Speculator(head, min_draft_prob=0.0)
    prompt = PROMPTS[2]
    seq, state, fresh = trunk.new_sequence(), speculator.new_state(), speculator.new_state()
    taps = trunk.forward([Segment(seq, prompt, logits="none", hidden=True, tap_layers=TAPS)])[0].hidden
    for s in (state, fresh):
        speculator.commit(s, prompt, taps, 0)
    ctx = DraftContext(last_token=7, pos=len(prompt), max_draft_tokens=3, min_draft_prob=0.0, hidden_prev=taps[-1])
    speculator.prepare(state, ctx)
    assert state.pending == [] and state.kv.held() == list(range(len(prompt) - 1))
    assert speculator.propose(state, ctx) == speculator.propose(fresh, ctx)  # folding in propose: same drafts
    speculator.keep(state, 2)
    more = trunk.forward([Segment(seq, [7, 40], logits="none", hidden=True, tap_layers=TAPS)])[0].hidden
    speculator.commit(state, [7, 40], more, len(prompt))
    speculator.prepare(state, DraftContext(last_token=9, pos=len(prompt) + 2, max_draft_tokens=3, min_draft_prob=0.0,
                                           hidden_prev=more[-1]))
    assert [row[0] for row in state.pending] == [len(prompt) + 1]  # d1's pair waits for the round


class TestEagle3Conformance(SpeculatorConformance):
    """The speculator suite with a random EAGLE-3 head, on the tiny llama trunk instead of the toy."""

    @pytest.fixture
    def toy_trunk(self, target):
        return target[2]

    @pytest.fixture
    def make_speculator(self, target, random_head):
        head = load(random_head, target[2])
        return lambda: Eagle3Speculator(head, max_draft_tokens=4, min_draft_prob=0.0)
