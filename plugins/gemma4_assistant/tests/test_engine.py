"""Through the engine on the tiny Gemma 4 trunks: `--spec-type draft-head --draft-model
assistant.gguf` picks the gemma4-assistant speculator and streams plain greedy's tokens; the
head drafts on a second turn that reuses the first turn's sequence and again after a batched
interlude (1 -> N -> 1), since it holds nothing the trunk does not."""
import pytest
import torch
from verispec.testing import assert_second_turn_streams_plain, run_greedy, run_greedy_requests
from verispec_gemma4.loader import load as load_trunk
from verispec_gemma4_assistant.loader import load
from verispec_gemma4_assistant.speculator import AssistantSpeculator

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 7, 77, 12, 30]


def _trunk(path, dtype="float32"):
    return load_trunk(path, dtype=dtype, use_cache=False, tokenizer=False, max_rows_per_forward=16,
                      max_verify_rows=16)


class Recording(AssistantSpeculator):
    """Logs (pos, number drafted) of every proposal into `events`."""

    def __init__(self, head, events, **kwargs):
        super().__init__(head, **kwargs)
        self.events = events

    def propose(self, state, ctx):
        draft = super().propose(state, ctx)
        self.events.append(("draft", ctx.pos, len(draft)))
        return draft


@pytest.mark.parametrize("name", ["e_style", "dense_31b_style"])
def test_draft_head_through_the_engine_streams_plain_greedy(pair_files, name):
    import verispec

    _, _, trunk_path, assistant_path = pair_files(name)
    plain = verispec.load(trunk_path, dtype="float32", enabled=False)
    want = [e.token for e in plain.generate(PROMPT, max_tokens=40, ignore_eos=True)]
    engine = verispec.load(trunk_path, dtype="float32", spec_type="draft-head", draft_model=assistant_path,
                           adaptive=False, min_draft_prob=0.0)
    generation = engine.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert [e.token for e in generation] == want
    assert generation.result.speculator == "gemma4-assistant"
    assert generation.result.spec.num_draft_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_streams_equal_plain_greedy_at_every_window(pair_files, dtype):
    _, _, trunk_path, assistant_path = pair_files("e_style")
    trunk = _trunk(trunk_path, dtype)
    head = load(assistant_path, trunk, use_cache=False)
    plain = run_greedy(trunk, PROMPT, 48)[0]
    for window in (1, 3, 7):
        speculator = AssistantSpeculator(head, max_draft_tokens=window, min_draft_prob=0.0)
        got, ex = run_greedy(trunk, PROMPT, 48, speculator, max_draft_tokens=window)
        assert got == plain, window
        assert ex.stats.num_draft_tokens > 0


def test_drafts_on_the_second_turn_after_prefix_reuse(pair_files):
    _, _, trunk_path, assistant_path = pair_files("dense_31b_style")
    trunk = _trunk(trunk_path)
    head = load(assistant_path, trunk, use_cache=False)
    events = []
    speculator = Recording(head, events, max_draft_tokens=3, min_draft_prob=0.0)
    second = assert_second_turn_streams_plain(trunk, speculator, PROMPT, max_draft_tokens=3)
    assert any(n and pos >= len(second) for _, pos, n in events)


def test_drafts_alone_beside_another_request_and_alone_again(pair_files):
    """Request 0 drafts alone, then beside request 1 (both drafting over the trunk's KV in shared
    forwards), then alone again; both streams are plain."""
    _, _, trunk_path, assistant_path = pair_files("e_style")
    trunk = _trunk(trunk_path)
    head = load(assistant_path, trunk, use_cache=False)
    events = []
    forward = trunk.forward

    def logged(batch):
        events.append(("forward", len(batch), 0))
        return forward(batch)

    trunk.forward = logged
    prompts, limits = [PROMPT, PROMPT[2:9]], [60, 12]
    want = [run_greedy(trunk, p, n)[0] for p, n in zip(prompts, limits)]
    events.clear()
    speculator = Recording(head, events, max_draft_tokens=3, min_draft_prob=0.0)
    runs = run_greedy_requests(trunk, prompts, limits, speculator, submit_at=[0, 6], max_draft_tokens=3)
    assert [tokens for tokens, _ in runs] == want
    batched = [i for i, (kind, n, _) in enumerate(events) if kind == "forward" and n > 1]
    drafted = [i for i, (kind, _, n) in enumerate(events) if kind == "draft" and n > 0]
    assert batched and drafted[0] < batched[0] and drafted[-1] > batched[-1]  # 1 -> N -> 1
    assert any(batched[0] < i < batched[-1] for i in drafted)  # and in between
    assert runs[1][1].stats.num_draft_tokens > 0


def test_the_mtp_chain_cannot_drive_it_and_decoding_goes_on(pair_files):
    """`--spec-type mtp` would chain the head without naming the sequence: draft_step refuses with
    the fix, the engine switches speculation off and decodes plainly."""
    pytest.importorskip("verispec_mtp_nextn")
    import verispec

    _, _, trunk_path, assistant_path = pair_files("dense_31b_style")
    plain = verispec.load(trunk_path, dtype="float32", enabled=False)
    want = [e.token for e in plain.generate(PROMPT, max_tokens=16, ignore_eos=True)]
    engine = verispec.load(trunk_path, dtype="float32", spec_type="mtp", draft_model=assistant_path, adaptive=False)
    assert [e.token for e in engine.generate(PROMPT, max_tokens=16, ignore_eos=True)] == want
    assert "drive it with --spec-type draft-head" in engine.fault
    head = load(assistant_path, _trunk(trunk_path), use_cache=False)
    with pytest.raises(ValueError, match="no sequence was set"):
        head.draft_step(head.new_state(), 1, torch.zeros(40), 3)
