"""Prefix caching: `fork` on the trunk seam (nn.state / nn.trunk) and the scheduler adopting
the longest cached prefix of an idle or a running sequence instead of prefilling it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import api
from verispec.engine import SpecOptions
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.state import CannotTruncate, SequenceState
from verispec.registry import Registry
from verispec.seams import Segment
from verispec.testing import ToyTrunk, forward_one, plain_logits, toy_plugin
from verispec.testing.toy import write_toy_gguf

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]


def test_a_fork_holds_the_prefix_and_leaves_the_source_unchanged():
    toy = ToyTrunk(recurrent=False)
    source = toy.new_sequence()
    forward_one(toy, source, PROMPT)
    fork = toy.fork(source, 5)
    assert (toy.seq_len(fork), toy.seq_len(source)) == (5, len(PROMPT))
    out = toy.forward([Segment(fork, [7, 7, 2], logits="all"), Segment(source, [4], logits="all")])
    assert torch.equal(out[0].logits, plain_logits(toy, PROMPT[:5] + [7, 7, 2])[5:])
    assert torch.equal(out[1].logits, plain_logits(toy, PROMPT + [4])[-1:])


def test_a_recurrent_sequence_forks_only_whole():
    toy = ToyTrunk(recurrent=True)
    source = toy.new_sequence()
    forward_one(toy, source, PROMPT)
    with pytest.raises(CannotTruncate, match="recurrent state"):
        toy.fork(source, 5)
    whole = toy.fork(source, len(PROMPT))
    out = toy.forward([Segment(whole, [4], logits="all")])[0]
    assert torch.equal(out.logits, plain_logits(toy, PROMPT + [4])[-1:])
    again = toy.forward([Segment(source, [4], logits="all")])[0]  # the copy did not share its state
    assert torch.equal(again.logits, out.logits)


def test_a_ring_forks_with_its_own_buffers():
    def written(n):
        state = SequenceState([RingKVCache(1, 2, window=4, max_rows=2, key_block=1)])
        for pos in range(n):
            state.begin(1, verify=False)
            state.layers[0].write(pos, torch.full((1, 1, 2), float(pos)), torch.full((1, 1, 2), float(pos)))
            state.seq_len += 1
        return state

    source = written(5)  # ring of 5 slots: positions 0..4
    fork = source.fork(4)
    assert fork.seq_len == 4 and sorted(fork.layers[0].tags.tolist()) == [-1, 0, 1, 2, 3]
    assert sorted(source.layers[0].tags.tolist()) == [0, 1, 2, 3, 4]
    fork.layers[0].k_t.zero_()
    assert source.layers[0].k_t.sum() > 0
    with pytest.raises(CannotTruncate, match="sliding-window ring"):
        written(9).fork(2)  # positions 0..3 were overwritten


def test_a_paged_fork_shares_blocks_and_copies_one_before_writing_it():
    source = SequenceState([PagedKVCache(1, 2, key_block=4, max_positions=64)])
    source.begin(10, verify=False)
    kv = torch.arange(10.0)[:, None, None].expand(10, 1, 2)
    source.layers[0].write(0, kv, kv)
    source.seq_len = 10
    fork = source.fork(6)  # blocks 0 (slots 0..3) and 1 (4..7), shared; block 2 stays the source's
    cache, theirs = fork.layers[0], source.layers[0]
    assert [b.data_ptr() for b in cache.k_blocks] == [b.data_ptr() for b in theirs.k_blocks[:2]]
    fork.begin(1, verify=False)
    cache.write(6, torch.full((1, 1, 2), -1.0), torch.full((1, 1, 2), -1.0))  # into shared block 1
    assert cache.k_blocks[0].data_ptr() == theirs.k_blocks[0].data_ptr()  # block 0 still shared
    assert cache.k_blocks[1].data_ptr() != theirs.k_blocks[1].data_ptr()  # block 1 copied first
    assert theirs.read(10)[0][0, :, 0].tolist() == list(range(10))  # the source is unchanged
    assert cache.read(7)[1][0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, -1]
    theirs.write(0, torch.full((1, 1, 2), 9.0), torch.full((1, 1, 2), 9.0))  # the source copies block 0 too
    assert cache.read(1)[0][0, 0, 0] == 0 and theirs.read(1)[0][0, 0, 0] == 9
    fork.truncate(3)
    assert len(cache.k_blocks) == 1  # memory follows the length


# -- the scheduler's prefix cache ---------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3)


SYSTEM = "you are a cat. you sit on the mat. you are a cat. "


def solo(model_path, registry, prompt, n):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    generation = engine.generate(prompt, max_tokens=n, ignore_eos=True)
    list(generation)
    return generation.result


def test_a_newcomer_copies_the_prefix_of_a_running_sequence(model_path, registry):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    first = engine.generate(SYSTEM + "where?", max_tokens=20, ignore_eos=True)
    for _ in range(3):
        engine.step()
    second = engine.generate(SYSTEM + "why?", max_tokens=12, ignore_eos=True)
    while not (first.done and second.done):
        engine.step()
        first.poll(), second.poll()
    shared = _shared(engine, SYSTEM + "where?", SYSTEM + "why?")
    assert second.result.reused_prefix_tokens == shared > len(engine.encode(SYSTEM)) - 2
    assert first.result.tokens == solo(model_path, registry, SYSTEM + "where?", 20).tokens
    assert second.result.tokens == solo(model_path, registry, SYSTEM + "why?", 12).tokens
    assert engine.scheduler.metrics.num_prefix_cache_hits == 1


def _shared(engine, a, b):
    x, y = engine.encode(a), engine.encode(b)
    n = 0
    while x[n] == y[n]:
        n += 1
    return n


def test_an_idle_prefix_serves_several_requests(model_path, registry):
    """Forking leaves the cached sequence: two later requests both skip the shared prefix."""
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False))
    list(engine.generate(SYSTEM + "hello", max_tokens=4, ignore_eos=True))
    results = []
    for question in ("where?", "why?"):
        generation = engine.generate(SYSTEM + question, max_tokens=8, ignore_eos=True)
        list(generation)
        results.append(generation.result)
        assert generation.result.tokens == solo(model_path, registry, SYSTEM + question, 8).tokens
    assert all(r.reused_prefix_tokens >= len(engine.encode(SYSTEM)) - 1 for r in results)
    assert engine.scheduler.metrics.num_prefix_cache_hits == 2


def test_only_speculators_that_declare_it_arm_after_prefix_reuse(model_path):
    """A speculator that cannot see reused rows stays off for a request that reused a prefix;
    one that declares can_arm_after_prefix_reuse drafts from the reused tokens at once."""
    from verispec.hookspecs import hookimpl
    from verispec.specs import SpeculatorSpec
    from verispec.testing.toy import ScriptedSpeculator

    def plugin(can_arm):
        class Repeat:
            @hookimpl
            def register_speculators(self, register):
                register(SpeculatorSpec(
                    name="repeat", summary="repeats the pending token (test)", priority=10,
                    can_arm_after_prefix_reuse=can_arm,
                    factory=lambda trunk, **kw: ScriptedSpeculator(lambda ctx: [ctx.last_token] * 2,
                                                                    max_draft_tokens=kw["max_draft_tokens"],
                                                                    spec=kw["spec"])))
        return Registry.from_plugins({"toy": toy_plugin, "repeat": Repeat()})

    for can_arm in (False, True):
        engine = api.load(model_path, registry=plugin(can_arm), spec_type="repeat", adaptive=False)
        results = []
        for question in ("where?", "why?"):
            generation = engine.generate(SYSTEM + question, max_tokens=8, ignore_eos=True)
            list(generation)
            results.append(generation.result)
        fresh, reused = results
        assert fresh.reused_prefix_tokens == 0 and fresh.spec.num_draft_tokens > 0
        assert reused.reused_prefix_tokens > 0
        assert (reused.spec.num_draft_tokens > 0) is can_arm
        assert reused.tokens == solo(model_path, Registry.from_plugins({"toy": toy_plugin}), SYSTEM + "why?", 8).tokens


@given(st.lists(st.integers(0, 2), max_size=200), st.lists(st.integers(0, 2), max_size=200),
       st.integers(0, 250), st.sampled_from([1, 3, 64]))
@settings(max_examples=300, deadline=None)
def test_common_prefix_compares_blocks_as_token_by_token(a, b, limit, block):
    from verispec.prefix_cache import common_prefix
    b = a[:len(b)] + b[len(a):] if len(b) > len(a) // 2 else b  # long shared prefixes are common too
    expected = 0
    while expected < min(limit, len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix(a, b, limit, block=block) == expected


class _CountingTrunk:
    """Sequences of a fixed length, one byte a position, recording what is released in order."""

    max_context_length = 1000

    def __init__(self):
        self.released = []

    def sequence_nbytes(self, positions: int) -> int:
        return positions

    def seq_len(self, seq: int) -> int:
        return 100

    def release(self, seq: int) -> None:
        self.released.append(seq)


def test_idle_sequences_past_the_limit_are_released_least_recently_used_first():
    from verispec.prefix_cache import PrefixCache

    trunk = _CountingTrunk()
    cache = PrefixCache(trunk, max_idle_sequences=2)
    for seq in (11, 12, 13):
        cache.park(seq, [seq] * 4)
    assert trunk.released == [11] and cache.sequences() == [12, 13]
    cache.park(14, [14] * 4)
    assert trunk.released == [11, 12] and cache.sequences() == [13, 14]
    seq, reused = cache.reuse([13] * 4 + [1], running=[])  # the next turn of 13 takes it over
    assert (seq, reused) == (13, 4) and cache.sequences() == [14]


def test_the_kv_budget_releases_the_oldest_idle_sequence_first():
    from verispec.kv_budget import KVBudget
    from verispec.nn.kv_cache import MAX_VERIFY_ROWS
    from verispec.prefix_cache import PrefixCache

    trunk = _CountingTrunk()
    cache = PrefixCache(trunk, max_idle_sequences=8)
    each = 100 + MAX_VERIFY_ROWS  # what an idle sequence of 100 positions counts
    budget = KVBudget(trunk, 4 * each, cache)
    for seq in (21, 22, 23, 24):
        cache.park(seq, [seq])
    assert budget.make_room(each) == 1 and trunk.released == [21]  # room for one: the oldest goes
    assert budget.make_room(2 * each) == 1 and trunk.released == [21, 22]
    assert budget.make_room(3 * each + 1, keep=23) == 1 and trunk.released == [21, 22, 24]  # `keep` goes last
    assert cache.sequences() == [23]
