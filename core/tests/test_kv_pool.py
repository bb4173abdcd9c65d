"""nn.kv_pool: a PooledKVCache holds what a PagedKVCache holds (writes across blocks, reads, keep,
truncate, fork with copy on write), and its pool's blocks go back to the free list when no cache
holds them (truncate, release, a dropped cache); the pool grows without moving a cache's data."""
import torch

from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.kv_pool import BlockPool, PooledKVCache

HKV, DH, B = 2, 4, 8


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, DH, generator=g), torch.randn(n, HKV, DH, generator=g)


def _pair(pool):
    return PagedKVCache(HKV, DH, key_block=B, max_positions=64), PooledKVCache(pool, max_positions=64)


def _write(caches, start, n, seed):
    k, v = _kv(n, seed)
    for c in caches:
        c.ensure_capacity(start + n)
        c.write(start, k, v)


def _same(a, b, slots):
    ka, va, pa = a.read(slots)
    kb, vb, pb = b.read(slots)
    assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pa, pb)


def test_writes_across_blocks_read_as_the_paged_cache():
    pool = BlockPool(HKV, DH, B, torch.device("cpu"), capacity=2)
    caches = _pair(pool)
    _write(caches, 0, 5, 0)
    _write(caches, 5, 13, 1)  # crosses two block boundaries and grows the pool (2 -> 4 blocks)
    assert pool.capacity == 4 and caches[1].ids == [0, 1, 2]
    _same(*caches, 18)
    assert caches[1].table().dtype == torch.int32 and caches[1].table().tolist() == [0, 1, 2]


def test_fork_shares_then_copies_on_write_and_frees_on_release():
    pool = BlockPool(HKV, DH, B, torch.device("cpu"), capacity=4)
    paged, pooled = _pair(pool)
    _write((paged, pooled), 0, 12, 2)
    child_paged, child = paged.fork(12), pooled.fork(12)
    assert child.ids == pooled.ids and pool.refs[:2] == [2, 2]
    _write((child_paged, child), 10, 3, 3)  # into the shared second block: copied first
    assert child.ids[0] == pooled.ids[0] and child.ids[1] != pooled.ids[1]
    _same(paged, pooled, 12)  # the parent keeps its old values
    _same(child_paged, child, 13)
    child.truncate(8)  # its copied block goes back
    assert len(child.ids) == 1 and pool.refs[pooled.ids[1]] == 1
    del child
    assert pool.refs[pooled.ids[0]] == 1
    held = list(pooled.ids)
    del pooled
    assert all(pool.refs[i] == 0 for i in held) and sorted(pool.free) == list(range(pool.capacity))


def test_a_reused_block_is_zeroed():
    pool = BlockPool(HKV, DH, B, torch.device("cpu"), capacity=1)
    c = PooledKVCache(pool, max_positions=64)
    _write([c], 0, 3, 4)
    del c
    c = PooledKVCache(pool, max_positions=64)
    c.ensure_capacity(1)
    assert pool.k.abs().sum() == 0 and pool.v.abs().sum() == 0
