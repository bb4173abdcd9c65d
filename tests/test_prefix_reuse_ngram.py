"""Prefix reuse with speculation armed over the reused tokens: a two-turn chat whose
second turn starts from the first turn's cached prefix. With the installed n-gram plugin
(it declares can_arm_after_prefix_reuse), turn 2 drafts from the reused tokens, its output
equals the no-speculation output, and the prefix-cache hits are the same with and without
speculation. On the toy plugin's GGUF; the echo-own scenario on the real Gemma 3 270M."""
import pytest

from verispec import api
from verispec.engine import SpecOptions
from verispec.registry import Registry
from verispec.testing import real_checkpoint, toy_plugin
from verispec.testing.toy import CHAT_TEMPLATE, write_toy_gguf

ngram_hooks = pytest.importorskip("verispec_ngram.hooks", reason="verispec-ngram is not installed")


def two_turns(engine, turns, max_tokens):
    """Run a conversation turn by turn, each answer joining it (chat messages through the
    model's template, or plain concatenated text without one); returns the results."""
    chat = engine.tokenizer.chat_template is not None
    messages, text, results = [], "", []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        text += turn
        generation = engine.generate(messages if chat else text, max_tokens=max_tokens, ignore_eos=True)
        list(generation)
        results.append(generation.result)
        messages.append({"role": "assistant", "content": generation.result.text})
        text += generation.result.text
    return results


def compare(engine, turns, max_tokens):
    """(plain results, speculative results, plain hits, speculative hits) on one engine."""
    runs, hits = [], []
    for spec in (SpecOptions(enabled=False), SpecOptions(spec_type="ngram", adaptive=False)):
        engine.update_speculation(spec)
        engine.reset_cache()
        before = engine.scheduler.metrics.num_prefix_cache_hits
        runs.append(two_turns(engine, turns, max_tokens))
        hits.append(engine.scheduler.metrics.num_prefix_cache_hits - before)
    return runs[0], runs[1], hits[0], hits[1]


def test_turn_two_reuses_turn_one_and_drafts_from_it(tmp_path):
    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110, recurrent=False, seed=3, chat_template=CHAT_TEMPLATE)
    registry = Registry.from_plugins({"toy": toy_plugin, "ngram": ngram_hooks})
    engine = api.load(path, registry=registry)
    turns = ["the cat sat on the mat. the cat sat on the mat.", "again: the cat sat on the mat."]
    plain, spec, plain_hits, spec_hits = compare(engine, turns, max_tokens=24)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert plain[1].reused_prefix_tokens == spec[1].reused_prefix_tokens > plain[0].prompt_tokens
    assert plain_hits == spec_hits == 1
    assert spec[1].speculator == "ngram" and spec[1].spec.num_draft_tokens > 0


@pytest.mark.real_checkpoint
def test_echo_own_on_gemma3_accepts_drafts_after_prefix_reuse():
    real_checkpoint("gemma3-270m")
    from verispec.bench.run import load_scenarios

    (scenario,) = load_scenarios(["echo-own"])
    engine = api.load("gemma3-270m")  # a base model without a chat template: turns are concatenated text
    plain, spec, plain_hits, spec_hits = compare(engine, scenario["turns"], max_tokens=48)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert plain_hits == spec_hits == 1 and spec[1].reused_prefix_tokens > plain[0].prompt_tokens
    assert spec[1].spec.num_accepted_tokens > 0
