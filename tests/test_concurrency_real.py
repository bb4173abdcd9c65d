"""Batch invariance as a product property, on the real Gemma 3 270M with its default weight
mode and with int8: every request's greedy stream is bitwise the stream it gets alone,
whatever runs beside it (staggered newcomers prefilling beside decodes, requests leaving
mid-way), with and without n-gram speculation. Takes ~2 min."""

import pytest

from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint

PROMPTS = [
    "The lighthouse keeper wrote in his log every evening. On the first night of the storm he wrote",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three facts about the moon:\n1.",
]
MAX_TOKENS = [24, 16, 20]


@pytest.fixture(scope="module", params=[None, "int8"], ids=["default-dtype", "int8"])
def engine(request):
    real_checkpoint("gemma3-270m")
    import verispec
    from verispec.engine import SpecOptions

    engine = verispec.load("gemma3-270m", dtype=request.param, spec=SpecOptions(enabled=False), prefill_chunk=16)
    assert engine.trunk.spec_batch_invariant  # both weight modes promise it
    return engine


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt's greedy stream alone in the engine (no cached prefix)."""
    streams = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        engine.reset_cache()
        generation = engine.generate(prompt, max_tokens=n, ignore_eos=True)
        list(generation)
        streams.append(generation.result.tokens)
    engine.reset_cache()
    return streams


def _staggered(engine, every):
    generations = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        generations.append(engine.generate(prompt, max_tokens=n, ignore_eos=True))
        for _ in range(every):
            engine.step()
    while not all(g.done for g in generations):
        engine.step()
        for g in generations:
            g.poll()
    engine.reset_cache()
    return [g.result.tokens for g in generations]


@pytest.mark.parametrize("every", [0, 3])
def test_each_stream_is_bitwise_its_solo_stream(engine, solo, every):
    """every=0: all three arrive together; 3: each arrives 3 steps after the one before, its
    16-row prefill chunks sharing forwards with the others' one-row decodes."""
    forwards, forward = [], engine.trunk.forward
    engine.trunk.forward = lambda batch: (forwards.append(len(batch)), forward(batch))[1]
    try:
        assert _staggered(engine, every) == solo
    finally:
        del engine.trunk.forward
    assert max(forwards) == 3


def test_speculation_beside_others_leaves_every_stream_unchanged(engine, solo):
    from verispec.engine import SpecOptions

    engine.update_speculation(SpecOptions(spec_type="ngram", adaptive=False))
    try:
        assert _staggered(engine, 2) == solo
    finally:
        engine.update_speculation(SpecOptions(enabled=False))
