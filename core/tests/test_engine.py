"""InferenceEngine and the Python API end to end, on the toy plugin's GGUF (real load path:
registry → TrunkSpec loader → tokenizer from GGUF → engine), with toy speculators."""
import pytest

from verispec import api
from verispec.engine import InferenceEngine, SpecOptions
from verispec.hookspecs import hookimpl
from verispec.registry import Registry, UnknownArchitecture
from verispec.speculator_choice import SpeculationUnavailable
from verispec.sampling import SamplingParams
from verispec.seams import ContextOverflow, DraftHead
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import EchoSpeculator, write_toy_gguf

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


class EchoPlugin:
    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="echo", summary="1-gram echo (test)", factory=lambda t, **kw: EchoSpeculator(
            kw["spec"], max_draft_tokens=kw["max_draft_tokens"]), priority=10))


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin, "echo": EchoPlugin()})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3)  # printable ASCII bytes only


def run(engine, prompt=PROMPT, **kw):
    generation = engine.generate(prompt, **kw)
    events = list(generation)
    return generation.result, events


def test_load_resolves_the_architecture_through_the_registry(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo")
    assert isinstance(engine, InferenceEngine)
    assert engine.choice.name == "echo"


def test_unknown_architecture_names_the_fix(tmp_path, registry):
    from verispec.testing.fixture_writer import write_gguf

    path = write_gguf(tmp_path / "x.gguf", arch="mamba9", metadata={}, tensors={}, vocab=None)
    with pytest.raises(UnknownArchitecture, match="pip install"):
        api.load(str(path), registry=registry)


def test_speculative_stream_equals_plain_and_events_arrive_one_token_at_a_time(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    spec, events = run(engine, max_tokens=48)
    engine.update_speculation(SpecOptions(enabled=False))
    plain, _ = run(engine, max_tokens=48)
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert [e.token for e in events] == spec.tokens
    assert "".join(e.text for e in events) == spec.text
    assert spec.spec.num_accepted_tokens > 0 and plain.speculator is None
    assert spec.governor.startswith("governor plain=")


def test_stop_string_spanning_tokens_truncates_text_and_says_stop(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    full, _ = run(engine, max_tokens=40, ignore_eos=True)
    start = next(i for i in range(len(full.text) - 3) if "\ufffd" not in full.text[i:i + 3] and i > 2)
    stop = full.text[start:start + 3]  # three characters: more than one byte-level token
    got, events = run(engine, max_tokens=40, stop=[stop], ignore_eos=True)
    assert got.finish_reason == "stop"
    assert got.text == full.text[:full.text.find(stop)]
    assert "".join(e.text for e in events) == got.text
    assert got.tokens == full.tokens[:len(got.tokens)] and len(got.tokens) < 40


def test_max_tokens_and_usage(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    got, events = run(engine, max_tokens=7, ignore_eos=True)
    assert len(got.tokens) == len(events) == 7 and got.finish_reason == "length"


def test_prompt_longer_than_the_context_is_refused(model_path, registry):
    engine = api.load(model_path, registry=registry, context_length=32)
    with pytest.raises(ContextOverflow, match="shorten the prompt") as raised:
        engine.generate("x" * 40)
    message = str(raised.value)  # fewer new tokens would not help: not suggested
    assert "--max-tokens" not in message
    assert f"larger --context-length, up to {engine.trunk.trained_context_length}" in message


def test_generation_stops_at_a_full_context(model_path, registry):
    engine = api.load(model_path, registry=registry, context_length=64, spec_type="echo", adaptive=False)
    ids = engine.encode(PROMPT)
    got, _ = run(engine, max_tokens=500, ignore_eos=True)
    assert got.finish_reason == "length" and len(ids) + len(got.tokens) == 64


def test_second_turn_reuses_the_prefix_and_matches_a_fresh_engine(model_path, registry):
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    first, _ = run(engine, max_tokens=16, ignore_eos=True)
    second_prompt = engine.encode(PROMPT) + first.tokens + engine.encode(" and the dog")
    second, _ = run(engine, second_prompt, max_tokens=16, ignore_eos=True)
    assert second.reused_prefix_tokens == len(engine.encode(PROMPT)) + len(first.tokens) - 1
    fresh = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    expected, _ = run(fresh, second_prompt, max_tokens=16, ignore_eos=True)
    assert second.tokens == expected.tokens
    assert second.spec.num_spec_steps > 0  # echo declares can_arm_after_prefix_reuse


def test_seeded_sampling_is_identical_with_and_without_speculation(model_path, registry):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, frequency_penalty=0.3)
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    spec, _ = run(engine, max_tokens=40, sampling=params, ignore_eos=True)
    engine.update_speculation(SpecOptions(enabled=False))
    plain, _ = run(engine, max_tokens=40, sampling=params, ignore_eos=True)
    assert spec.tokens == plain.tokens


def test_explicit_type_that_cannot_serve_is_an_error(model_path, registry):
    with pytest.raises(SpeculationUnavailable, match="draft head"):
        api.load(model_path, registry=registry, spec_type="toy-block")


def test_a_refusing_trunk_decodes_plainly_under_auto_and_errors_for_an_explicit_type(model_path, registry, caplog):
    trunk = api.load_registered_trunk(model_path, registry)
    trunk.speculation_refusal = "verify rows differ from decode rows"
    with pytest.raises(SpeculationUnavailable, match="the trunk refuses speculation: verify rows differ"):
        InferenceEngine(trunk, registry=registry, spec=SpecOptions(spec_type="echo"))
    with caplog.at_level("WARNING", logger="verispec"):
        engine = InferenceEngine(trunk, registry=registry, spec=SpecOptions(spec_type="auto"))
    assert engine.speculator is None
    assert [r.getMessage() for r in caplog.records] == ["speculation off: verify rows differ from decode rows"]


def test_block_head_from_a_draft_file_with_drafter_requested_taps(model_path, registry, tmp_path):
    drafter = toy_plugin.write_block_drafter(tmp_path / "drafter.gguf", vocab_size=110)
    engine = api.load(model_path, registry=registry, spec_type="block", draft_model=drafter, adaptive=False)
    assert engine.choice.name == "toy-block"
    spec, _ = run(engine, max_tokens=32, ignore_eos=True)
    head = engine.speculator.head
    assert head.h_shapes == {(2 * 16,)}  # the taps it asked for, [F = 2·D]
    assert isinstance(head, DraftHead)
    states = []
    new_state = engine.speculator.new_state
    engine.speculator.new_state = lambda: states.append(new_state()) or states[-1]
    engine.reset_cache()  # toy-block cannot arm after prefix reuse: prefill the prompt afresh
    run(engine, max_tokens=8, ignore_eos=True)
    # the head's state for that request saw the whole prompt (its own, not shared with the first request)
    assert len(states) == 1 and states[0]["num_caught_up"] >= len(engine.encode(PROMPT))
    engine.update_speculation(SpecOptions(enabled=False))
    plain, _ = run(engine, max_tokens=32, ignore_eos=True)
    assert spec.tokens == plain.tokens


def test_a_draft_model_no_installed_speculator_takes_names_the_plugin_to_install(model_path, registry, caplog):
    """--draft-model naming a whole model with no draft-model speculator installed: the warning
    says so and names its install line, not the first speculator's decline."""
    from verispec.install_hints import checkout_root

    with caplog.at_level("WARNING", logger="verispec"):
        engine = api.load(model_path, registry=registry, draft_model=model_path)
    assert engine.choice.name == "echo"
    warning, = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert "is not used: no installed speculator drafts with a draft model" in warning
    assert f"pip install -e {checkout_root()}/plugins/draft_model " in warning and "toy-block" not in warning


def test_drafter_bound_to_another_trunk_is_refused(model_path, registry, tmp_path):
    drafter = toy_plugin.write_block_drafter(tmp_path / "drafter.gguf", vocab_size=111)
    with pytest.raises(toy_plugin.DrafterMismatch, match="111 != trunk vocabulary 110"):
        api.load(model_path, registry=registry, spec_type="block", draft_model=drafter)


def test_spec_options_validate_ranges():
    with pytest.raises(ValueError, match="--spec-draft 0"):
        SpecOptions(max_draft_tokens=0)
    with pytest.raises(ValueError, match="--spec-draft 65: choose 1..64"):
        SpecOptions(max_draft_tokens=65)
    with pytest.raises(ValueError, match="--spec-pmin 1.5"):
        SpecOptions(min_draft_prob=1.5)


def test_bench_compares_plain_and_speculative_on_every_scenario(model_path, registry):
    from verispec.bench.run import compare, format_table, load_scenarios

    scenarios = load_scenarios()
    assert {"prose", "quote-code", "quote-text", "echo-own", "json-edit", "one-word"} <= {s["name"] for s in scenarios}
    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False, context_length=4096)
    single = next(s for s in scenarios if "prompt" in s)
    multi = next(s for s in scenarios if s.get("turns"))
    rows = [compare(engine, {**s, "max_new_tokens": 12}, SpecOptions(spec_type="echo", adaptive=False))
            for s in (single, multi)]
    for row, turns in zip(rows, (1, len(multi["turns"]))):
        assert row["identical"] is True and row["new_tokens"] == 12 * turns
        assert row["plain_decode_tps"] > 0 and row["spec_decode_tps"] > 0
    assert "identical" in format_table(rows)
    with pytest.raises(ValueError, match="unknown scenario"):
        load_scenarios(["nope"])


def test_recurrent_trunk_reuses_only_an_exact_continuation(tmp_path, registry):
    path = write_toy_gguf(tmp_path / "rec.gguf", vocab_size=110, recurrent=True, seed=3)
    engine = api.load(path, registry=registry, spec_type="echo", adaptive=False)
    fresh = api.load(path, registry=registry, spec=SpecOptions(enabled=False))
    first, _ = run(engine, max_tokens=8, ignore_eos=True)
    prompt = engine.encode(PROMPT)
    continuation = prompt + first.tokens  # the cache holds exactly prompt + first.tokens[:-1]
    second, _ = run(engine, continuation, max_tokens=8, ignore_eos=True)
    assert second.reused_prefix_tokens == len(continuation) - 1
    assert second.tokens == run(fresh, continuation, max_tokens=8, ignore_eos=True)[0].tokens
    diverged = prompt[:-3] + engine.encode("dog")  # would need a rewind: recurrent state cannot
    third, _ = run(engine, diverged, max_tokens=8, ignore_eos=True)
    assert third.reused_prefix_tokens == 0
    assert third.tokens == run(fresh, diverged, max_tokens=8, ignore_eos=True)[0].tokens


def test_a_time_limit_or_a_cancel_ends_the_generation_at_a_token_with_length(model_path, registry):
    import time

    engine = api.load(model_path, registry=registry, spec_type="echo", adaptive=False)
    plain = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    generation = engine.generate(PROMPT, max_tokens=60, ignore_eos=True)
    for n, _ in enumerate(generation, 1):
        if n == 7:
            generation.cancel()
    cut = generation.result
    assert cut.finish_reason == "length" and 7 <= len(cut.tokens) < 60  # a verify window may finish
    assert cut.tokens == run(plain, max_tokens=len(cut.tokens), ignore_eos=True)[0].tokens
    forward = engine.trunk.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.01)
        return forward(*args, **kwargs)
    engine.trunk.forward = slow_forward
    limited, _ = run(engine, max_tokens=100, ignore_eos=True, time_limit=0.05)
    assert limited.finish_reason == "length" and 1 <= len(limited.tokens) < 100
    assert limited.tokens == run(plain, max_tokens=len(limited.tokens), ignore_eos=True)[0].tokens
    del engine.trunk.forward
    assert run(engine, max_tokens=20, ignore_eos=True)[0].tokens == run(plain, max_tokens=20, ignore_eos=True)[0].tokens
    with pytest.raises(ValueError, match="time_limit=0"):
        engine.generate(PROMPT, time_limit=0)


def test_a_speculator_class_without_a_name_reports_its_registered_name(model_path):
    """A speculator class that sets no `name` is named by the SpeculatorSpec it was built over
    (Speculator.name is spec.name), never `speculator=speculator`."""
    class Nameless(EchoSpeculator):
        pass

    class NamelessPlugin:
        @hookimpl
        def register_speculators(self, register):
            register(SpeculatorSpec(name="nameless-echo", summary="no name attribute (test)", priority=10,
                                    factory=lambda t, **kw: Nameless(kw["spec"], max_draft_tokens=kw["max_draft_tokens"])))

    assert "name" not in vars(Nameless) and "name" not in vars(EchoSpeculator)
    engine = api.load(model_path, registry=Registry.from_plugins({"toy": toy_plugin, "n": NamelessPlugin()}),
                      spec_type="nameless-echo", adaptive=False)
    result, _ = run(engine, max_tokens=8)
    assert engine.speculator.name == "nameless-echo" and result.speculator == "nameless-echo"
    assert result.spec.num_draft_tokens > 0


def test_a_slow_speculator_is_parked_at_its_first_warm_call_and_named_once_the_text_plain(model_path, caplog):
    """A plugin whose propose sleeps twice what a full window of plain decodes costs (the governor's
    own baseline, so no load on the machine can make it look fast): at most its first
    COLD_PROPOSE_CALLS calls are excused as cold (a call past COLD_SLACK one-row forwards is judged
    at once), the next parks it, and the cost model, which has now measured it, never calls it
    again: one warning naming it, the plain text."""
    import time

    from verispec.cost_model import COLD_PROPOSE_CALLS

    engines, losses_at_calls = [], []
    plain_engine = api.load(model_path, registry=Registry.from_plugins({"toy": toy_plugin}),
                            spec=SpecOptions(enabled=False))
    text = plain_engine.encode(PROMPT) + run(plain_engine, max_tokens=64, ignore_eos=True)[0].tokens

    class SlowEcho(EchoSpeculator):  # slow, and always right: only its cost can stop it
        def propose(self, history, ctx):
            governor = engines[0].governor()[0]
            losses_at_calls.append(governor.stats.losses)
            time.sleep(max(0.02, 2 * ctx.max_draft_tokens * governor.stats.plain_ms_per_token / 1e3))
            return text[ctx.pos + 1:ctx.pos + 1 + ctx.max_draft_tokens]

    class SlowPlugin:
        @hookimpl
        def register_speculators(self, register):
            register(SpeculatorSpec(
                name="slow-echo", summary="1-gram echo with a slow propose (test)", priority=10,
                factory=lambda t, **kw: SlowEcho(kw["spec"], max_draft_tokens=kw["max_draft_tokens"])))

    registry = Registry.from_plugins({"toy": toy_plugin, "slow": SlowPlugin()})
    engines.append(api.load(model_path, registry=registry, spec_type="slow-echo"))
    with caplog.at_level("WARNING", logger="verispec"):
        spec, _ = run(engines[0], max_tokens=64, ignore_eos=True)
    assert losses_at_calls[0] == 0 and len(losses_at_calls) <= COLD_PROPOSE_CALLS + 2
    assert engines[0].governor()[0].stats.losses >= 1
    assert len(caplog.records) == 1
    assert "speculator 'slow-echo'" in caplog.text and "propose took" in caplog.text
    engines[0].update_speculation(SpecOptions(enabled=False))
    plain, _ = run(engines[0], max_tokens=64, ignore_eos=True)
    assert spec.tokens == plain.tokens and spec.text == plain.text and len(spec.tokens) == 64
