"""The KV/state memory budget: each state kind's `max_nbytes` bounds (exactly) what it allocates,
and the scheduler keeps running reservations plus idle sequences within `kv_budget_bytes`: the
queue's head waits, idle sequences are released for it, and a request that could never fit is
refused with InvalidArgument."""
import pytest
import torch

from verispec import api
from verispec.engine import InferenceEngine, SpecOptions
from verispec.errors import InvalidArgument
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.state import RecurrentState, SequenceState
from verispec.registry import Registry
from verispec.testing import ToyTrunk, forward_one, toy_plugin
from verispec.testing.toy import write_toy_gguf

PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat", "a dog ran. a dog ran. a",
           "one two three one two three one"]


def allocated(tensors) -> int:
    """Bytes of the storages behind these tensors, each counted once (independent of nn.state)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def write_rows(state: SequenceState, cache, rows: int) -> None:
    """`rows` positions through SequenceState.begin (which grows the caches) and `write`."""
    start = state.begin(rows, verify=False)
    kv = torch.ones(rows, cache.num_kv_heads, cache.head_dim)  # [n, Hkv, Dh]
    cache.write(start, kv, kv)
    state.seq_len += rows


# -- (a) each kind's bound is what it really allocates -------------------------------------------

def test_a_paged_cache_holds_exactly_max_nbytes_whatever_its_history():
    def grown(history):
        cache = PagedKVCache(2, 8, key_block=4, max_positions=50)
        state = SequenceState([cache])
        for rows in history:
            write_rows(state, cache, rows)
        return cache, allocated(cache.k_blocks + cache.v_blocks)

    block_bytes = 2 * 2 * 8 * 4 * 4  # K and V, 2 heads, 8 dims, 4 slots, fp32
    for n in range(1, 51):
        bound = grown([])[0].max_nbytes(n)
        assert bound == -(-n // 4) * block_bytes
        for history in ([1] * n, [n], [n - 1, 1] if n > 1 else [1]):
            cache, size = grown(history)
            assert size == bound == cache.nbytes()
    assert grown([])[0].max_nbytes(80) == 13 * block_bytes  # capped at max_positions (52 slots)


def test_a_ring_and_a_recurrent_state_hold_their_fixed_size_at_any_length():
    ring = RingKVCache(2, 8, window=6, max_rows=3, key_block=4)
    state = SequenceState([ring])
    for n in range(1, 30):
        write_rows(state, ring, 1 + n % 3)
        assert allocated([ring.k_t, ring.v, ring.tags]) == ring.max_nbytes(state.seq_len) == ring.nbytes()

    recurrent = RecurrentState({"conv": (2, 5), "matrix": (5, 5)}, dtype=torch.float64)
    state = SequenceState([recurrent])
    for n in range(1, 10):
        state.begin(1, verify=False)
        recurrent.update({"conv": torch.randn(1, 2, 5, dtype=torch.float64),
                          "matrix": torch.randn(1, 5, 5, dtype=torch.float64)})
        state.seq_len += 1
        assert allocated(recurrent.values.values()) == recurrent.max_nbytes(n) == (10 + 25) * 8
    # a verify's rows are held too while it lasts, and `nbytes` sees them
    state.begin(4, verify=True)
    recurrent.update({"conv": torch.randn(4, 2, 5, dtype=torch.float64),
                      "matrix": torch.randn(4, 5, 5, dtype=torch.float64)})
    assert recurrent.nbytes() == (4 + 1) * (10 + 25) * 8  # the 4 rows, and the state before the verify


def test_a_trunk_reports_what_a_sequence_of_it_allocates():
    toy = ToyTrunk(recurrent=True, max_context_length=512)
    n = 200  # key_block 64: a 192-row prefill, then single rows: 4 blocks
    seq = toy.new_sequence()
    forward_one(toy, seq, [i % 30 for i in range(192)])
    for i in range(192, n):
        forward_one(toy, seq, [i % 30])
    recurrent, cache = toy._state(seq).layers
    assert cache.capacity == 256
    real = allocated(cache.k_blocks + cache.v_blocks) + allocated(recurrent.values.values())
    assert toy.sequence_nbytes(n) == real == toy.sequence_held_nbytes(seq)
    assert toy.sequence_nbytes(512) > toy.sequence_nbytes(n)  # it does depend on the length


# -- the scheduler --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins({"toy": toy_plugin})


@pytest.fixture(scope="module", params=[False, True], ids=["attention", "recurrent"])
def model_path(request, tmp_path_factory):
    return write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=request.param,
                          seed=3)


def engine_with(model_path, registry, budget, *, trunk=None, **kw):
    trunk = trunk or api.load_registered_trunk(model_path, registry)
    return InferenceEngine(trunk, registry=registry, spec=SpecOptions(enabled=False), kv_budget_bytes=budget, **kw)


def solo(model_path, registry, prompt, **kw):
    engine = api.load(model_path, registry=registry, spec=SpecOptions(enabled=False), kv_cache_gb=0)
    generation = engine.generate(prompt, **kw)
    list(generation)
    return generation.result


def reservation(engine, prompt, max_tokens):
    return engine.scheduler.kv_budget.reservation(len(engine.encode(prompt)), max_tokens, engine.trunk.max_context_length)


def held(engine, seqs):
    return sum(engine.trunk.sequence_held_nbytes(seq) for seq in seqs)


REQUESTS = [dict(prompt=PROMPTS[0], max_tokens=20, ignore_eos=True),
            dict(prompt=PROMPTS[1], max_tokens=30, ignore_eos=True),
            dict(prompt=PROMPTS[2], max_tokens=10, ignore_eos=True)]


def test_a_third_request_waits_for_room_and_every_stream_equals_its_solo_stream(model_path, registry):
    probe = engine_with(model_path, registry, 1 << 40)
    first, second, third = (reservation(probe, kw["prompt"], kw["max_tokens"]) for kw in REQUESTS)
    budget = first + second
    assert third > 0  # so the third cannot fit beside them
    engine = engine_with(model_path, registry, budget, max_idle_sequences=0)
    scheduler = engine.scheduler
    generations = [engine.generate(**kw) for kw in REQUESTS]
    trace = []
    while not all(g.done for g in generations):
        engine.step()
        for g in generations:
            g.poll()
        running = [r.seq for r in scheduler._running]
        trace.append((scheduler.num_running, scheduler.num_waiting, [g.done for g in generations]))
        assert scheduler.kv_budget.reserved_bytes <= budget
        assert held(engine, running) <= scheduler.kv_budget.reserved_bytes  # the reservations bound what is allocated
    assert trace[0][:2] == (2, 1)  # the budget, not max_running (16), held the third back
    admitted = next(i for i, (_, waiting, _) in enumerate(trace) if waiting == 0)
    assert admitted > 1 and trace[admitted - 1][2][0] and not trace[admitted - 2][2][0]  # the step after the first finished
    for kw, generation in zip(REQUESTS, generations):
        expected = solo(model_path, registry, **kw)
        assert generation.result.tokens == expected.tokens and generation.result.text == expected.text
    assert scheduler.kv_budget.reserved_bytes == 0


def test_a_request_larger_than_the_budget_is_refused_and_the_next_is_served(model_path, registry):
    probe = engine_with(model_path, registry, 1 << 40)
    small = dict(prompt=PROMPTS[1], max_tokens=8, ignore_eos=True)
    budget = reservation(probe, small["prompt"], small["max_tokens"])
    engine = engine_with(model_path, registry, budget)
    with pytest.raises(InvalidArgument, match=rf"KV budget of {budget} bytes.*ask for at most max_tokens") as e:
        engine.generate(PROMPTS[0], max_tokens=300)
    room = int(str(e.value).split("at most max_tokens ")[1].split(",")[0])
    assert e.value.param == "max_tokens" and room >= 1
    assert reservation(engine, PROMPTS[0], room) <= budget  # the largest that fits, named exactly
    with pytest.raises(InvalidArgument):
        reservation(engine, PROMPTS[0], room + 1)
    generation = engine.generate(**small)
    list(generation)
    assert generation.result.tokens == solo(model_path, registry, **small).tokens
    # a budget lowered while it was queued: refused at admission, through its generation
    queued = engine.generate(**small)
    engine.scheduler.kv_budget.budget_bytes = budget - 1
    with pytest.raises(InvalidArgument, match=f"KV budget of {budget - 1} bytes"):
        list(queued)
    engine.scheduler.kv_budget.budget_bytes = budget
    generation = engine.generate(**small)
    list(generation)
    assert generation.result.tokens == solo(model_path, registry, **small).tokens
    assert engine.scheduler.kv_budget.reserved_bytes == 0 and not engine.has_work


def test_idle_sequences_are_released_to_admit_a_request(model_path, registry):
    first, second = REQUESTS[1], REQUESTS[0]  # the second's reservation leaves no room for the first's sequence
    probe = engine_with(model_path, registry, 1 << 40)
    need = max(reservation(probe, kw["prompt"], kw["max_tokens"]) for kw in (first, second))
    roomy = engine_with(model_path, registry, 1 << 40)
    tight = engine_with(model_path, registry, need)
    for engine in (roomy, tight):
        list(engine.generate(**first))
        assert len(engine.scheduler.prefix_cache) == 1 and engine.scheduler.kv_budget.idle_bytes > 0
        generation = engine.generate(**second)
        list(generation)
        assert generation.result.tokens == solo(model_path, registry, **second).tokens
    assert roomy.scheduler.metrics.num_kv_budget_evictions == 0 and len(roomy.scheduler.prefix_cache) == 2
    assert tight.scheduler.metrics.num_kv_budget_evictions == 1 and len(tight.scheduler.prefix_cache) == 1
    assert tight.scheduler.kv_budget.idle_bytes <= need


def test_an_idle_sequence_the_prompt_continues_is_taken_over_not_evicted(model_path, registry):
    first = REQUESTS[0]
    probe = engine_with(model_path, registry, 1 << 40)
    list(probe.generate(**first))
    history = probe.scheduler.prefix_cache.tokens(probe.scheduler.prefix_cache.sequences()[0])  # the prompt and the answer, as the sequence holds them
    turn = history + [40, 41, 42]
    need = probe.scheduler.kv_budget.reservation(len(turn), 8, probe.trunk.max_context_length)
    engine = engine_with(model_path, registry, need)  # no room for the idle sequence beside a new one
    list(engine.generate(**first))
    generation = engine.generate(turn, max_tokens=8, ignore_eos=True)
    list(generation)
    assert generation.result.reused_prefix_tokens == len(history)
    assert engine.scheduler.metrics.num_kv_budget_evictions == 0
    assert generation.result.tokens == solo(model_path, registry, turn, max_tokens=8, ignore_eos=True).tokens


class Unbudgeted:
    """A trunk without `sequence_nbytes` (a third-party one): everything else delegated."""

    def __init__(self, trunk):
        self._trunk = trunk

    def __getattr__(self, name):
        if name in ("sequence_nbytes", "sequence_held_nbytes"):
            raise AttributeError(name)
        return getattr(self._trunk, name)


def test_a_trunk_without_sequence_nbytes_is_not_budgeted(model_path, registry):
    with pytest.raises(InvalidArgument, match="KV budget of 1 bytes"):
        engine_with(model_path, registry, 1)
    engine = engine_with(model_path, registry, 1, trunk=Unbudgeted(api.load_registered_trunk(model_path, registry)))
    generations = [engine.generate(**kw) for kw in REQUESTS]
    engine.step()
    assert engine.scheduler.num_running == 3 and engine.scheduler.kv_budget.reserved_bytes == 0
    while not all(g.done for g in generations):
        engine.step()
        for g in generations:
            g.poll()
    for kw, generation in zip(REQUESTS, generations):
        assert generation.result.tokens == solo(model_path, registry, **kw).tokens
    assert engine.scheduler.kv_budget.idle_bytes == 0


def test_the_default_budget_is_half_the_available_memory(model_path, registry, monkeypatch):
    monkeypatch.setattr(api, "available_memory_bytes", lambda device=None: 10 << 30)
    assert api.load(model_path, registry=registry).scheduler.kv_budget.budget_bytes == 5 << 30
    assert api.load(model_path, registry=registry, kv_cache_gb=1.5).scheduler.kv_budget.budget_bytes == 3 << 29
    assert api.load(model_path, registry=registry, kv_cache_gb=0).scheduler.kv_budget.budget_bytes is None
    monkeypatch.setattr(api, "available_memory_bytes", lambda device=None: None)
    assert api.load(model_path, registry=registry).scheduler.kv_budget.budget_bytes is None
    for bad in (-1, "abc", float("inf"), float("nan"), True, 1e-12):
        with pytest.raises(InvalidArgument, match=f"kv_cache_gb={bad!r}" if isinstance(bad, str) else "kv_cache_gb="):
            api.load(model_path, registry=registry, kv_cache_gb=bad)


def test_on_a_gpu_the_default_budget_is_half_its_free_memory(monkeypatch, caplog):
    """A placed trunk's KV lives on the GPU: the default budget is half the device's free memory
    (torch.cuda.mem_get_info), and an explicit budget is held against it, not the host's."""
    import torch

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 << 30, 80 << 30))
    assert api.available_memory_bytes(cuda) == 6 << 30
    assert api.kv_budget_bytes(None, cuda) == 3 << 30
    with caplog.at_level("WARNING", logger=api.log.name):
        assert api.kv_budget_bytes(8, cuda) == 8 << 30
    assert "8 GiB is more than the 6 GiB of GPU memory available now" in caplog.text


def test_a_budget_that_cannot_hold_one_sequence_is_refused_at_load(model_path, registry):
    probe = engine_with(model_path, registry, 1 << 40)
    smallest = probe.scheduler.kv_budget.smallest_reservation()
    assert smallest == reservation(probe, "a", 1) or len(probe.encode("a")) > 1
    with pytest.raises(InvalidArgument, match=f"cannot hold one sequence.*reserves {smallest} bytes"):
        engine_with(model_path, registry, smallest - 1)
    engine_with(model_path, registry, smallest)  # exactly enough: accepted


def test_a_prompt_the_budget_cannot_hold_is_told_to_shrink(model_path, registry):
    probe = engine_with(model_path, registry, 1 << 40)
    budget = reservation(probe, PROMPTS[2], 1)
    engine = engine_with(model_path, registry, budget)
    long_prompt = " ".join([PROMPTS[2]] * 8)
    with pytest.raises(InvalidArgument, match="shorten the prompt to at most") as e:
        engine.generate(long_prompt, max_tokens=1)
    assert e.value.param is None


def test_metrics_show_the_budget_and_the_reservations(model_path, registry):
    pytest.importorskip("fastapi")
    from verispec.server import prometheus_text

    engine = engine_with(model_path, registry, 1 << 20)
    generation = engine.generate(**REQUESTS[0])
    engine.step()
    reserved = engine.scheduler.kv_budget.reserved_bytes
    assert reserved == reservation(engine, REQUESTS[0]["prompt"], REQUESTS[0]["max_tokens"]) > 0
    text = prometheus_text(engine)
    assert f"verispec_kv_budget_bytes {1 << 20}\n" in text and f"verispec_kv_reserved_bytes {reserved}\n" in text
    list(generation)
    text = prometheus_text(engine)
    assert "verispec_kv_reserved_bytes 0\n" in text
    assert f"verispec_kv_idle_bytes {engine.scheduler.kv_budget.idle_bytes}\n" in text and engine.scheduler.kv_budget.idle_bytes > 0
