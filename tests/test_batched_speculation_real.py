"""Batched speculation on real weights: with every decoding request drafting in a shared forward
(n-gram, and a draft model), each request's stream — tokens and the top-5 logprobs of every
row it drew, bitwise — is the stream it gets alone without speculation, whatever runs beside it
and whatever the others draft. Real Gemma 3 270M and SmolLM2-135M, 2 to 6 requests, quoting and
free prompts, greedy and seeded sampling."""

import pytest

from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint

PROMPTS = [
    "Repeat this line exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return a + b + c\n\n\ndef add_four(",
    "The lighthouse keeper wrote in his log every evening. On the first night of the storm he wrote",
    "List three facts about the moon:\n1.",
    '{"id": 1, "name": "Alder", "city": "Lisbon"}\n{"id": 2, "name": "Birch", "city": "Porto"}\n{"id": 3,',
    "Once upon a time, in a village by the sea,",
]
MAX_TOKENS = [28, 24, 16, 20, 26, 12]


def _generate(engine, requests, every):
    """Submit each (prompt, max_tokens, sampling) `every` steps after the one before; run all."""
    generations = []
    for prompt, n, sampling in requests:
        generations.append(engine.generate(prompt, max_tokens=n, ignore_eos=True, sampling=sampling))
        for _ in range(every):
            engine.step()
    events = [[] for _ in generations]
    while not all(g.done for g in generations):
        engine.step()
        for i, g in enumerate(generations):
            events[i] += g.poll()
    for i, g in enumerate(generations):
        events[i] += g.poll()
    engine.reset_cache()
    return [[(e.token, e.logprob, e.top_logprobs) for e in ev] for ev in events], [g.result for g in generations]


def _requests(seeded: bool):
    from verispec.sampling import SamplingParams

    params = [SamplingParams(logprobs=5, **({"temperature": 0.8, "top_p": 0.95, "seed": 11 + i} if seeded else {}))
              for i in range(len(PROMPTS))]
    return list(zip(PROMPTS, MAX_TOKENS, params))


@pytest.fixture(scope="module", params=["gemma3-270m", "smollm2-135m-instruct"])
def engine(request):
    real_checkpoint(request.param)
    import verispec
    from verispec.engine import SpecOptions

    engine = verispec.load(request.param, spec=SpecOptions(enabled=False), prefill_chunk=32)
    assert engine.trunk.spec_batch_invariant
    engine.alias = request.param  # the draft model of the draft-model test: the model itself
    return engine


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_each_stream_is_bitwise_its_solo_plain_stream_while_everyone_drafts(engine, seeded):
    from verispec.engine import SpecOptions

    requests = _requests(seeded)
    solo = [_generate(engine, [r], 0)[0][0] for r in requests]
    verifies = []
    forward = engine.trunk.forward
    engine.trunk.forward = lambda batch: (verifies.append(sum(s.verify for s in batch)), forward(batch))[1]
    try:
        for spec in (SpecOptions(spec_type="ngram", adaptive=False), SpecOptions(spec_type="ngram")):
            engine.update_speculation(spec)
            for every, count in ((0, 2), (2, 6)):
                streams, results = _generate(engine, requests[:count], every)
                assert streams == solo[:count], (spec, every, count)
    finally:
        del engine.trunk.forward
        engine.update_speculation(SpecOptions(enabled=False))
    assert max(verifies) >= 2  # several requests' drafts were verified in one forward


def test_a_draft_model_drafts_for_every_request_of_the_batch(engine):
    """The model drafting for itself (same tokenizer, every draft right under greedy): batched
    verify rows of several requests, streams unchanged, most drafts accepted."""
    from verispec.engine import SpecOptions

    requests = _requests(seeded=False)[:4]
    solo = [_generate(engine, [r], 0)[0][0] for r in requests]
    engine.update_speculation(SpecOptions(spec_type="draft-model", draft_model=engine.alias, adaptive=False))
    try:
        streams, results = _generate(engine, requests, 1)
    finally:
        engine.update_speculation(SpecOptions(enabled=False))
    assert streams == solo
    drafted = sum(r.spec.num_draft_tokens for r in results)
    accepted = sum(r.spec.num_accepted_tokens for r in results)
    assert drafted > 0 and accepted > 0.8 * drafted

