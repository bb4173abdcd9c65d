"""Real checkpoints through the engine, SmolLM2-135M-Instruct and Gemma 3 270M (each skipped, naming
the install line, when its packages are not installed): suffix-drafted streams equal the plain one
whatever the engine-wide index holds, and a finished request's output reaches the next one through
the engine's own lifecycle."""
import random

import pytest
from verispec.engine import SpecOptions
from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint

PROMPT = [{"role": "user", "content": "List three facts about the Moon, one line each."}]
UNRELATED = ("The quarterly report covers revenue, staffing and the new warehouse in Rotterdam. "
             "Shipping times fell by two days after the conveyor upgrade; returns stayed flat. ")
NUM_TOKENS = 40
SUFFIX = SpecOptions(spec_type="suffix", adaptive=False, min_draft_prob=0.0)


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def engine(request):
    import verispec

    return verispec.load(real_checkpoint(request.param), enabled=False, kv_cache_gb=0)


@pytest.fixture(scope="module")
def plain(engine):
    engine.update_speculation(SpecOptions(enabled=False))
    return [e.token for e in engine.generate(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True)]


def generate(engine):
    generation = engine.generate(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [e.token for e in generation], generation.result.spec


def adversarial(text, vocab_size):
    """Every window of `text` (1..6 tokens) followed by wrong tokens, three times over."""
    docs = []
    for end in range(1, len(text)):
        wrong = [(t * 7 + 13) % vocab_size for t in text[end:end + 8]]
        docs.extend([text[max(0, end - n):end] + wrong for n in range(1, 7)] * 3)
    return docs


@pytest.mark.parametrize("fill", ["unrelated", "adversarial"])
def test_the_stream_is_plain_whatever_the_shared_index_holds(engine, plain, fill):
    engine.update_speculation(SUFFIX)
    speculator = engine.speculator
    vocab = engine.trunk.vocab_size
    if fill == "unrelated":
        rng = random.Random(0)
        docs = [engine.encode(UNRELATED)] * 20 + [[rng.randrange(vocab) for _ in range(300)] for _ in range(10)]
    else:
        docs = adversarial(engine.encode(PROMPT, chat=True) + plain, vocab)
    speculator.shared.max_tokens = 10**6
    for d in docs:
        speculator.shared.add(d)
    tokens, stats = generate(engine)
    assert tokens == plain
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # it drafted, and was wrong
    if fill == "adversarial":
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2


def test_a_finished_request_teaches_the_next_through_the_engine(engine, plain):
    engine.update_speculation(SUFFIX)
    engine.reset_cache()  # no prefix reuse: the second request prefills as the first did
    first, first_stats = generate(engine)
    engine.reset_cache()
    second, second_stats = generate(engine)
    assert first == second == plain
    # the engine let go of the first request's state (no gc.collect): its output was folded (less
    # what it decoded before the speculator armed, and the pending last token)
    (folded,) = engine.speculator.shared.documents
    assert len(folded) >= NUM_TOKENS // 2
    assert any(first[i:i + len(folded)] == folded for i in range(len(first)))
    assert second_stats.num_accepted_tokens > first_stats.num_accepted_tokens
    assert second_stats.num_accepted_tokens >= NUM_TOKENS // 2
