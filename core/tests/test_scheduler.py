"""Continuous batching (verispec.scheduler) through the engine, on the toy plugin's GGUF: each
request's stream equals its solo stream whatever runs beside it, and the speculation rules
(every decoding request drafts in a shared forward, an interlude survived without re-arming,
never armed for under two tokens, one shared governor)."""
import pytest

from verispec import api
from verispec.engine import SpecOptions
from verispec.hookspecs import hookimpl
from verispec.registry import Registry
from verispec.sampling import SamplingParams
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import EchoSpeculator, write_toy_gguf

PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat", "a dog ran. a dog ran. a",
           "one two three one two three one"]


class EchoPlugin:
    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="echo", summary="1-gram echo (test)", can_arm_after_prefix_reuse=True,
                                factory=lambda t, **kw: EchoSpeculator(kw["spec"],
                                                                       max_draft_tokens=kw["max_draft_tokens"]),
                                priority=10))


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin, "echo": EchoPlugin()})


@pytest.fixture(scope="module", params=[False, True], ids=["attention", "recurrent"])
def model_path(request, tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=request.param,
                          seed=3)


def solo(model_path, registry, prompt, **kw):
    """The stream a request gets alone in a fresh engine without speculation."""
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    generation = engine.generate(prompt, **kw)
    list(generation)
    return generation.result


def record_forwards(engine):
    """Wrap the trunk's forward: returns a list that gets (num_running, [segments]) per call."""
    calls, forward = [], engine.trunk.forward

    def recording(batch):
        calls.append((engine.scheduler.num_running, list(batch)))
        return forward(batch)
    engine.trunk.forward = recording
    return calls


def drain(engine, generations):
    """Step the engine until every generation is done; returns their results."""
    while not all(g.done for g in generations):
        engine.step()
        for g in generations:
            g.poll()
    return [g.result for g in generations]


def staggered(engine, requests, every=3):
    """Submit requests `every` steps apart (kwargs dicts for generate), then run all to the end."""
    generations = []
    for kw in requests:
        generations.append(engine.generate(**kw))
        for _ in range(every):
            engine.step()
    return drain(engine, generations)


REQUESTS = [dict(prompt=PROMPTS[0], max_tokens=30, ignore_eos=True),
            dict(prompt=PROMPTS[1], max_tokens=12, ignore_eos=True,
                 sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5)),
            dict(prompt=PROMPTS[2], max_tokens=25, ignore_eos=True, sampling=SamplingParams(frequency_penalty=0.5))]


def test_staggered_requests_each_equal_their_solo_stream(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False), prefill_chunk=8)
    calls = record_forwards(engine)
    results = staggered(engine, REQUESTS)
    for kw, got in zip(REQUESTS, results):
        expected = solo(model_path, registry, **kw)
        assert got.tokens == expected.tokens and got.text == expected.text
    assert max(len(batch) for _, batch in calls) == 3  # the three really shared forwards
    # a newcomer's prefill was chunked beside the others' one-row decodes, within 8 rows a step
    mixed = [batch for _, batch in calls if len(batch) > 1 and any(s.tokens.numel() > 1 for s in batch)]
    assert mixed and all(sum(s.tokens.numel() for s in batch) <= 8 for batch in mixed)
    assert engine.scheduler.num_running == 0


def test_simultaneous_requests_with_stop_strings_equal_their_solo_streams(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    full = solo(model_path, registry, PROMPTS[0], max_tokens=30, ignore_eos=True)
    stop = full.text[10:13]
    requests = [dict(prompt=PROMPTS[0], max_tokens=30, ignore_eos=True, stop=[stop]),
                dict(prompt=PROMPTS[1], max_tokens=20, ignore_eos=True)]
    results = drain(engine, [engine.generate(**kw) for kw in requests])
    assert results[0].finish_reason == "stop" and results[0].text == full.text[:full.text.find(stop)]
    assert results[1].tokens == solo(model_path, registry, **requests[1]).tokens


def test_every_decoding_request_verifies_its_drafts_in_the_shared_forward(model_path, registry):
    """Two requests decode together: one forward carries both requests' verify rows (ragged: each
    its own k), beside a prefill chunk when one arrives, and each stream is its solo plain one."""
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    calls = record_forwards(engine)
    requests = [dict(prompt=PROMPTS[0], max_tokens=40, ignore_eos=True),
                dict(prompt=PROMPTS[1], max_tokens=16, ignore_eos=True),
                dict(prompt=PROMPTS[2], max_tokens=12, ignore_eos=True)]
    results = staggered(engine, requests, every=4)
    shared = [batch for _, batch in calls if sum(s.verify for s in batch) >= 2]
    assert shared  # two sequences' drafts verified in one forward
    assert any(len({s.tokens.numel() for s in batch}) > 1 for batch in shared) or \
        any(any(not s.verify for s in batch) for _, batch in calls if any(s.verify for s in batch))
    for kw, got in zip(requests, results):
        assert got.tokens == solo(model_path, registry, **kw).tokens
    assert all(r.spec.num_spec_steps > 0 for r in results[:2])


def test_a_hidden_free_speculator_arms_at_its_first_draft(model_path, registry, monkeypatch):
    """n-gram-like speculators prefill plainly: their first commit is the whole held sequence,
    made at the request's first drafting step, and the stream is still the plain one."""
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    commits = []
    original = EchoSpeculator.commit

    def commit(self, history, tokens, hidden_rows, start_pos):
        emitted = len(engine.scheduler._running[0].stop_state.tokens)
        commits.append((start_pos, len(tokens), emitted))
        original(self, history, tokens, hidden_rows, start_pos)
    monkeypatch.setattr(EchoSpeculator, "commit", commit)
    prompt = PROMPTS[0]
    result = drain(engine, [engine.generate(prompt, max_tokens=40, ignore_eos=True)])[0]
    assert commits[0] == (0, len(engine.encode(prompt)), 1)  # after the first token, not at the prefill
    assert result.spec.num_spec_steps > 0
    assert result.tokens == solo(model_path, registry, prompt, max_tokens=40, ignore_eos=True).tokens


def test_speculation_survives_an_interlude_without_rearming(model_path, registry):
    """1 → 2 → 1: the first request speculates alone, beside the second, then alone again, over
    one speculator state that saw every token (no new state, no re-seed)."""
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    calls = record_forwards(engine)
    first = engine.generate(PROMPTS[0], max_tokens=60, ignore_eos=True)
    stats = None
    for _ in range(20):  # until it has speculated alone
        engine.step()
        stats = engine.scheduler._running[0].execution.stats
        if stats.num_spec_steps:
            break
    states_before, spec_steps_before = EchoSpeculator.num_states, stats.num_spec_steps
    assert spec_steps_before > 0
    second = engine.generate(PROMPTS[1], max_tokens=5, ignore_eos=True)
    while not second.done:
        engine.step()
        second.poll()
    interlude = len(calls)
    request = engine.scheduler._running[0]
    drain(engine, [first])
    assert EchoSpeculator.num_states == states_before + 1  # the second's own state; the first was not re-armed
    assert first.result.spec.num_spec_steps > spec_steps_before  # speculating again after the interlude
    assert any(any(s.verify for s in batch) for _, batch in calls[interlude:])
    held = engine.trunk.seq_len(request.seq)  # kept idle for prefix reuse
    seen = request.execution._state + request.execution._unseen  # the rest waits for a next draft (deferred)
    assert seen == (engine.encode(PROMPTS[0]) + first.result.tokens)[:held]
    assert first.result.tokens == solo(model_path, registry, PROMPTS[0], max_tokens=60, ignore_eos=True).tokens


@pytest.mark.parametrize("max_tokens,armed", [(2, False), (3, True)])
def test_a_request_that_cannot_decode_two_tokens_is_never_armed(model_path, registry, max_tokens, armed):
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    calls = record_forwards(engine)
    (result,) = drain(engine, [engine.generate(PROMPTS[0], max_tokens=max_tokens, ignore_eos=True)])
    assert (result.spec.num_spec_steps + result.spec.num_no_draft_steps > 0) is armed  # asked to draft
    assert armed or not any(s.verify for _, batch in calls for s in batch)


def test_one_governor_is_shared_by_all_requests(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo")
    generations = [engine.generate(p, max_tokens=6, ignore_eos=True) for p in PROMPTS[:2]]
    engine.step()
    governors = {id(r.execution.governor) for r in engine.scheduler._running}
    assert governors == {id(engine.governor()[0])}
    drain(engine, generations)
    later = engine.generate(PROMPTS[2], max_tokens=6, ignore_eos=True)
    engine.step()
    assert engine.scheduler._running[0].execution.governor is engine.governor()[0]
    drain(engine, [later])


def test_a_cancelled_request_leaves_at_once_and_its_sequence_is_released(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    released, release = [], engine.trunk.release
    engine.trunk.release = lambda seq: (released.append(seq), release(seq))
    kept = engine.generate(PROMPTS[0], max_tokens=20, ignore_eos=True)
    gone = engine.generate(PROMPTS[1], max_tokens=20, ignore_eos=True)
    engine.step()
    engine.step()
    seq = next(r.seq for r in engine.scheduler._running if r.generation is gone)
    gone.cancel()
    engine.step()
    assert engine.scheduler.num_running == 1 and released == [seq]
    gone.poll()
    assert gone.done and gone.result.finish_reason == "length" and len(gone.result.tokens) == 2
    waiting = engine.generate(PROMPTS[2], max_tokens=20)
    waiting.cancel()  # never admitted: no sequence at all
    drain(engine, [kept, waiting])
    assert waiting.result.tokens == [] and released == [seq]
    assert kept.result.tokens == solo(model_path, registry, PROMPTS[0], max_tokens=20, ignore_eos=True).tokens


def test_a_failing_step_fails_its_requests_and_the_engine_serves_the_next(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    forward = engine.trunk.forward

    def broken(batch):
        raise IndexError("a bug")
    engine.trunk.forward = broken
    generation = engine.generate(PROMPTS[0], max_tokens=4)
    with pytest.raises(IndexError, match="a bug"):
        list(generation)
    engine.trunk.forward = forward
    assert engine.scheduler.num_running == 0
    (result,) = drain(engine, [engine.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)])
    assert result.tokens == solo(model_path, registry, PROMPTS[0], max_tokens=4, ignore_eos=True).tokens


def test_admission_is_capped_and_waiting_requests_run_later(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False), max_running=2)
    generations = [engine.generate(p, max_tokens=5, ignore_eos=True) for p in PROMPTS]
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 1
    results = drain(engine, generations)
    for prompt, got in zip(PROMPTS, results):
        assert got.tokens == solo(model_path, registry, prompt, max_tokens=5, ignore_eos=True).tokens
    # the third waited for a slot: its queue time covers at least the first two's decode steps
    assert results[2].queued_ms > 0 and results[0].queued_ms < results[2].queued_ms


def test_update_speculation_applies_between_steps(model_path, registry):
    """A policy change mid-request: the running request goes on plainly (its speculator is
    closed), its stream unchanged; the next request uses the new policy."""
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    first = engine.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)
    for _ in range(6):
        engine.step()
    engine.update_speculation(SpecOptions(enabled=False))
    calls = record_forwards(engine)
    drain(engine, [first])
    assert not any(s.verify for _, batch in calls for s in batch)
    assert first.result.tokens == solo(model_path, registry, PROMPTS[0], max_tokens=40, ignore_eos=True).tokens
    engine.update_speculation(SpecOptions(spec_type="echo", adaptive=False))
    (second,) = drain(engine, [engine.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)])
    assert second.speculator == "echo" and second.spec.num_spec_steps > 0


def test_scheduler_sizes_are_checked(model_path, registry):
    from verispec.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="max_running=0"):
        api.load(model_path, registry=registry, max_running=0)


def test_switching_speculation_off_stops_a_request_that_has_not_drafted_yet(model_path, registry):
    """update_speculation(enabled=False) after the request's first step: its (not yet armed, deferred)
    speculator never drafts for it afterwards, and its reason says speculation was switched off."""
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    generation = engine.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)
    engine.step()  # the prefill and the first token: nothing drafted yet
    request = engine.scheduler._running[0]
    assert request.execution.stats.num_draft_tokens == 0 and request.execution._state is None
    engine.update_speculation(SpecOptions(enabled=False))
    (result,) = drain(engine, [generation])
    assert result.spec.num_draft_tokens == 0 and result.spec.num_spec_steps == 0
    assert result.spec.plain_steps["detached"] == len(result.tokens) - 1
    assert result.reason.code == "off"
    assert result.tokens == solo(model_path, registry, PROMPTS[0], max_tokens=40, ignore_eos=True).tokens


@pytest.mark.parametrize("answer", ["raise", "short"])
def test_a_propose_batch_that_fails_switches_every_caller_off_and_the_streams_stay_plain(model_path, registry, answer,
                                                                                        caplog):
    """Two requests draft together; on the third batched call the speculator raises (or answers one
    draft for two contexts): both requests fault, go on plainly, and each stream is its plain one."""
    calls = []

    class Flaky(EchoSpeculator):
        def propose_batch(self, states, ctxs):
            calls.append(len(ctxs))
            if len(calls) >= 3 and len(ctxs) == 2:
                if answer == "raise":
                    raise RuntimeError("batch bug")
                return [[]]
            return super().propose_batch(states, ctxs)

    class FlakyPlugin:
        @hookimpl
        def register_speculators(self, register):
            register(SpeculatorSpec(name="flaky", summary="fails in a batch (test)", can_arm_after_prefix_reuse=True,
                                    factory=lambda t, **kw: Flaky(kw["spec"], max_draft_tokens=kw["max_draft_tokens"]),
                                    priority=10))

    engine = api.load(model_path, registry=Registry.from_plugins({"toy": toy_plugin, "f": FlakyPlugin()}),
                      spec_type="flaky", adaptive=False)
    requests = [dict(prompt=PROMPTS[0], max_tokens=30, ignore_eos=True),
                dict(prompt=PROMPTS[1], max_tokens=24, ignore_eos=True)]
    with caplog.at_level("WARNING", logger="verispec"):
        results = drain(engine, [engine.generate(**kw) for kw in requests])
    assert any(n == 2 for n in calls)
    for kw, got in zip(requests, results):
        assert got.tokens == solo(model_path, registry, **kw).tokens
        assert got.reason.code == "faulted" and ("batch bug" in got.reason.text or "ids for" in got.reason.text
                                                 or "returned" in got.reason.text)
    assert sum("switched off for this engine" in r.getMessage() for r in caplog.records) == 1
