"""The `draft-model` speculator on tiny qwen2 fixtures (a second trunk drafting) and the toy trunk.

A drafter that is the trunk's own file, loaded again, must propose exactly what the trunk
decodes (acceptance 1.0: the kernels are batch-invariant, so its one-row forwards equal the
trunk's verify rows); an unrelated drafter is mostly wrong; either way the stream is plain
greedy's. The lag the drafter keeps (prompt, batched interlude, prefix reuse) is caught up.
"""
import gc

import pytest
import torch
from verispec.seams import DraftContext, DraftModel, Segment
from verispec.speculator_choice import SpeculationUnavailable, choose_speculator
from verispec.registry import Registry, UnknownArchitecture
from verispec.testing import SpeculatorConformance, ToyTrunk, run_greedy, run_greedy_requests
from verispec_draft_model import hooks
from verispec_draft_model.binding import binding_problem
from verispec_draft_model.speculator import DraftModelSpeculator

pytest.importorskip("verispec_llama")
from tiny_llama import build_hf_model, write_fixture  # noqa: E402 (models/llama/tests, on pytest's pythonpath)
from verispec_llama.loader import load  # noqa: E402

NOISE = 0.1
PROMPT = [5, 17, 33, 60, 71, 9, 44, 102, 87, 23, 5, 17, 33, 60, 12, 99, 130, 4, 58, 77] * 2


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """name -> GGUF path: the trunk (qwen2), a near copy of it (its weights with NOISE relative
    noise: some drafts accepted, some not) and a llama of another vocabulary."""
    directory = tmp_path_factory.mktemp("draft_model")
    near = build_hf_model("qwen2")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for weight in near.parameters():
            weight.add_(torch.randn(weight.shape, generator=g) * NOISE * weight.std())
    return {"trunk": write_fixture(build_hf_model("qwen2"), directory / "trunk.gguf"),
            "near": write_fixture(near, directory / "near.gguf"),
            "llama": write_fixture(build_hf_model("llama"), directory / "llama.gguf")}


@pytest.fixture(scope="module")
def trunk(paths):
    return load(paths["trunk"])


def speculator(draft, trunk, **kwargs):
    return DraftModelSpeculator(draft, trunk.vocab_size, max_draft_tokens=kwargs.pop("max_draft_tokens", 4),
                                min_draft_prob=0.0, **kwargs)


def plain(trunk, prompt, n):
    return run_greedy(trunk, prompt, n)[0]


def exact_drafts(spec, text):
    """Wrap spec.propose_batch (what the engine calls); returns the list of (proposal, what `text`
    holds there) it made."""
    made, propose_batch = [], spec.propose_batch

    def recording(states, ctxs):
        drafts = propose_batch(states, ctxs)
        made.extend((draft, text[ctx.pos + 1:ctx.pos + 1 + len(draft)]) for draft, ctx in zip(drafts, ctxs))
        return drafts
    spec.propose_batch = recording
    return made


def assert_exact(made, min_drafted):
    """Every proposal was the text's continuation (the last window may run past max_tokens: the
    loop counts its tail rejected, so acceptance is judged here against the text)."""
    assert sum(len(draft) for draft, _ in made) >= min_drafted
    for draft, truth in made[:-1]:
        assert draft == truth
    assert made[-1][0][:len(made[-1][1])] == made[-1][1]


def test_the_trunks_own_file_drafts_exactly_what_it_decodes(paths, trunk):
    spec = speculator(load(paths["trunk"]), trunk)
    text = PROMPT + plain(trunk, PROMPT, 48)
    made = exact_drafts(spec, text)
    tokens, execution = run_greedy(trunk, PROMPT, 48, spec)
    assert PROMPT + tokens == text
    assert_exact(made, 30)
    assert execution.stats.num_no_draft_steps == 0


def test_a_near_drafter_gives_the_plain_stream_and_drafts_from_the_committed_text(paths, trunk):
    """Some drafts are rejected, and each step's first draft is still the drafter's greedy token
    after exactly the committed text: rejected rows were cut off its state."""
    spec = speculator(load(paths["near"]), trunk)
    text = PROMPT + plain(trunk, PROMPT, 48)
    made, positions, propose_batch = [], [], spec.propose_batch

    def recording(states, ctxs):
        drafts = propose_batch(states, ctxs)
        positions.extend(ctx.pos for ctx in ctxs)
        made.extend(drafts)
        return drafts
    spec.propose_batch = recording
    tokens, execution = run_greedy(trunk, PROMPT, 48, spec)
    assert PROMPT + tokens == text
    assert 0.2 < execution.stats.acceptance_rate < 0.9
    reference = load(paths["near"])
    seq = reference.new_sequence()
    rows = reference.forward([Segment(seq, text, logits="all")])[0].logits.argmax(-1).tolist()
    assert [draft[0] for draft in made if draft] == [rows[pos] for pos, draft in zip(positions, made) if draft]


@pytest.mark.parametrize("draft_context", [1, 7, 1000])
def test_a_drafter_reading_a_suffix_of_the_prompt_still_gives_the_plain_stream(paths, trunk, draft_context):
    spec = speculator(load(paths["trunk"]), trunk, draft_context=draft_context)
    tokens, execution = run_greedy(trunk, PROMPT, 32, spec)
    assert tokens == plain(trunk, PROMPT, 32) and execution.stats.num_draft_tokens > 0


def test_the_requests_of_a_batch_draft_together_one_drafter_forward_per_position(paths, trunk):
    """Request 0 speculates alone, then beside request 1 (both drafting in one propose_batch call
    per step, one drafter forward per draft position over both), then alone again: every draft
    is the exact continuation of its own request's text."""
    draft = load(paths["trunk"])
    spec = speculator(draft, trunk)
    prompts, limits = [PROMPT, PROMPT[3:30]], [100, 30]
    texts = [prompt + plain(trunk, prompt, limit) for prompt, limit in zip(prompts, limits)]
    made, calls, propose_batch = [], [], spec.propose_batch

    def recording(states, ctxs):
        drafts = propose_batch(states, ctxs)
        calls.append(len(ctxs))
        for state, ctx, proposal in zip(states, ctxs, drafts):
            held = state.tokens[:ctx.pos] + [ctx.last_token]
            text = next(t for t in texts if t[:len(held)] == held)
            made.append((proposal, text[ctx.pos + 1:ctx.pos + 1 + len(proposal)]))
        return drafts
    spec.propose_batch = recording
    widths, forward = [], draft.forward
    draft.forward = lambda batch: widths.append(len(batch)) or forward(batch)
    runs = run_greedy_requests(trunk, prompts, limits, spec, submit_at=[0, 6])
    for (tokens, _), prompt, text in zip(runs, prompts, texts):
        assert prompt + tokens == text
    assert max(calls) == 2 and max(widths) == 2  # one call and one forward per position for both
    assert all(ex.stats.num_draft_tokens > 0 for _, ex in runs)
    assert_exact(made, 30)


def test_a_reused_prefix_is_caught_up_and_drafted_over(paths, trunk):
    """The second request starts from the first's cached sequence: its drafter sees every held token."""
    first = PROMPT[:25]
    second = first + plain(trunk, first, 12) + [7, 8, 9]
    spec = speculator(load(paths["trunk"]), trunk)
    text = second + plain(trunk, second, 40)
    made = exact_drafts(spec, text)
    runs = run_greedy_requests(trunk, [second], [40], spec)  # the drafter caught up over all of it
    assert second + runs[0][0] == text
    assert_exact(made, 20)
    spec = speculator(load(paths["trunk"]), trunk)
    runs = run_greedy_requests(trunk, [first, second], [12, 40], spec, max_running=1)
    assert runs[1][1].seq == runs[0][1].seq  # the second request took the first one's sequence over
    assert runs[1][0] == text[len(second):]
    assert runs[1][1].stats.num_draft_tokens > 20


def test_a_dropped_state_frees_its_drafter_sequence(paths, trunk):
    draft = load(paths["trunk"])
    released = []
    release = draft.release
    draft.release = lambda seq: (released.append(seq), release(seq))
    spec = speculator(draft, trunk)
    state = spec.new_state()
    spec.commit(state, PROMPT, None, 0)
    seq = state.seq
    del state
    gc.collect()
    spec.new_state()  # frees what was dropped, on the caller's thread
    assert released == [seq]
    spec.close()
    assert len(released) == 2


def test_a_prompt_past_the_drafters_context_drafts_only_while_it_can(paths, trunk):
    draft = load(paths["trunk"], context_length=len(PROMPT) + 3)
    spec = speculator(draft, trunk, max_draft_tokens=8)
    tokens, execution = run_greedy(trunk, PROMPT, 24, spec)
    assert tokens == plain(trunk, PROMPT, 24)
    assert 0 < execution.stats.num_draft_tokens <= 3


def test_the_gate_stops_the_draft_below_min_draft_prob(paths, trunk):
    spec = DraftModelSpeculator(load(paths["trunk"]), trunk.vocab_size, max_draft_tokens=8)
    state = spec.new_state()
    spec.commit(state, PROMPT, None, 0)
    ctx = dict(last_token=PROMPT[0], pos=len(PROMPT), max_draft_tokens=8)
    assert spec.propose(state, DraftContext(**ctx, min_draft_prob=1.0)) == []
    spec.keep(state, 1)
    assert len(spec.propose(state, DraftContext(**ctx, min_draft_prob=0.0))) == 8


# -- binding -----------------------------------------------------------------------------


class _Tokenizer:
    def __init__(self, tokens, bos_id=2, eos_id=1, stop_ids=(1,)):
        self.tokens, self.bos_id, self.eos_id, self.stop_ids = list(tokens), bos_id, eos_id, tuple(stop_ids)


class _Named(ToyTrunk):
    def __init__(self, tokenizer, **kwargs):
        super().__init__(vocab_size=len(tokenizer.tokens), recurrent=False, **kwargs)
        self.tokenizer = tokenizer


PIECES = ["<pad>", "<eos>", "<bos>", "a", "b", "c", "ab", "bc"]


def test_a_drafter_padded_past_the_trunks_vocabulary_binds():
    assert binding_problem(_Named(_Tokenizer(PIECES)), _Named(_Tokenizer(PIECES + ["<pad1>", "<pad2>"]))) is None


@pytest.mark.parametrize("draft_tokenizer, named", [
    (_Tokenizer(PIECES[:5] + ["x"] + PIECES[6:]), "differ at id 5: the trunk's piece is 'c', the drafter's 'x'"),
    (_Tokenizer(PIECES[:6]), "has 6 pieces, the trunk's 8"),
    (_Tokenizer(PIECES, eos_id=0), "eos_id differ: the trunk's 1, the drafter's 0"),
    (_Tokenizer(PIECES, stop_ids=(1, 7)), "stop_ids differ"),
])
def test_a_drafter_of_another_tokenizer_is_refused_naming_the_difference(draft_tokenizer, named):
    assert named in binding_problem(_Named(_Tokenizer(PIECES)), _Named(draft_tokenizer))


def test_a_drafter_that_cannot_cut_its_state_is_refused():
    assert "cannot cut a rejected draft" in binding_problem(ToyTrunk(16, recurrent=False), ToyTrunk(16))


def test_through_the_registry_a_foreign_drafter_declines_with_the_first_differing_piece(paths, trunk):
    registry = Registry.from_plugins({"draft_model": hooks})
    head = DraftModel(load(paths["llama"]), paths["llama"])
    with pytest.raises(SpeculationUnavailable, match=r"draft-model: --draft-model .*llama.gguf: the tokenizers "
                                                     r"differ at id \d+: the trunk's piece is"):
        choose_speculator(registry, "draft-model", trunk, draft_head=head, max_draft_tokens=4)
    choice = choose_speculator(registry, "auto", trunk, draft_head=head, max_draft_tokens=4)
    assert choice.speculator is None and "differ at id" in choice.declines["draft-model"]


def test_without_a_draft_model_it_declines_before_building(trunk):
    registry = Registry.from_plugins({"draft_model": hooks})
    with pytest.raises(SpeculationUnavailable, match="no draft head"):
        choose_speculator(registry, "draft-model", trunk, max_draft_tokens=4)


# -- through the engine ---------------------------------------------------------------------


def test_auto_picks_the_draft_model_a_trunk_file_names_and_the_text_is_plain(paths):
    import verispec

    plain_text = verispec.load(paths["trunk"], enabled=False).generate(PROMPT, max_tokens=24, ignore_eos=True)
    plain_tokens = [e.token for e in plain_text]
    engine = verispec.load(paths["trunk"], draft_model=paths["trunk"], adaptive=False, min_draft_prob=0.0)
    assert engine.choice.name == "draft-model"
    generation = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    assert [e.token for e in generation] == plain_tokens
    stats = generation.result.spec  # every draft accepted but those past max_tokens
    assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens > stats.num_draft_tokens - 8


def test_under_auto_a_draft_model_that_does_not_fit_is_named_in_a_warning(paths, caplog):
    import verispec

    with caplog.at_level("WARNING", logger="verispec"):
        engine = verispec.load(paths["trunk"], draft_model=paths["llama"])
    assert engine.choice.name != "draft-model"
    warning, = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    declines = "; " + warning.split("llama.gguf is not used: ", 1)[1]  # every draft-head speculator's reason
    assert "; draft-model: " in declines and "the tokenizers differ at id" in warning


def test_a_draft_model_of_no_known_architecture_names_both_lists(paths, tmp_path):
    import verispec
    from verispec.testing.fixture_writer import write_gguf

    path = write_gguf(tmp_path / "odd.gguf", arch="oddnet", metadata={}, tensors={"x.weight": torch.ones(2)}, vocab=None)
    with pytest.raises(UnknownArchitecture, match=r"drafter files or models with general.architecture='oddnet' "
                                                  r"\(installed: .*qwen2"):
        verispec.load(paths["trunk"], draft_model=path)


class TestConformance(SpeculatorConformance):
    """The core suite on the toy trunk, a second toy (attention-only: it can cut a draft) drafting."""

    @pytest.fixture
    def make_speculator(self):
        return lambda: DraftModelSpeculator(ToyTrunk(vocab_size=16, recurrent=False), 16, max_draft_tokens=4,
                                            min_draft_prob=0.0)
