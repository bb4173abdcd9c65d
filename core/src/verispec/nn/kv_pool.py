"""Paged KV in one pool per layer: the caches of a trunk on a device (`TrunkModule.to_device`).

`kernels.triton_attend` reads every sequence's K/V through block tables of indices into two pool
tensors, so on a device a layer's blocks are rows of one `BlockPool` shared by all the trunk's
sequences, and a sequence's `PooledKVCache` holds the indices of its blocks. Semantics are
`kv_cache.PagedKVCache`'s (slot = position, blocks of B = key_block slots grown as the sequence
grows, forks share blocks and copy on write, `keep` moves nothing); only where the blocks live
differs. The CPU trunks keep `PagedKVCache` (a tensor per block, read by the C kernels through
data pointers) and never see this module.

Pool layout (`triton_attend`'s): keys transposed k fp32 [capacity, Hkv, Dh, B], values v fp32
[capacity, Hkv, B, Dh]; a block's reference count says how many caches' tables hold it (forks),
and a block whose count falls to 0 goes back to the free list. The pool doubles when full (the
tensors are copied, so caches hold indices, never views).
"""
from __future__ import annotations

import copy

import torch

from verispec.nn.kv_cache import PagedKVCache, block_runs

__all__ = ["BlockPool", "PooledKVCache"]


class BlockPool:
    """One layer's K/V blocks for every sequence of a trunk, on `device`."""

    def __init__(self, num_kv_heads: int, head_dim: int, block: int, device: torch.device, capacity: int = 8):
        self.num_kv_heads, self.head_dim, self.block, self.device = num_kv_heads, head_dim, block, device
        self.k = torch.zeros(capacity, num_kv_heads, head_dim, block, device=device)
        self.v = torch.zeros(capacity, num_kv_heads, block, head_dim, device=device)
        self.refs = [0] * capacity
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest index first

    @property
    def capacity(self) -> int:
        return len(self.refs)

    def alloc(self) -> int:
        """A zeroed block held once (zeroed: a masked slot still multiplies its V by 0 in the
        kernel, and 0 · NaN of uninitialised memory would be NaN)."""
        if not self.free:
            self._grow()
        index = self.free.pop()
        self.k[index].zero_()
        self.v[index].zero_()
        self.refs[index] = 1
        return index

    def copy(self, src: int) -> int:
        """A new block holding block `src`'s K/V (copy on write), held once."""
        index = self.alloc()
        self.k[index].copy_(self.k[src])
        self.v[index].copy_(self.v[src])
        return index

    def retain(self, index: int) -> None:
        self.refs[index] += 1

    def release(self, index: int) -> None:
        self.refs[index] -= 1
        if self.refs[index] == 0:
            self.free.append(index)

    def _grow(self) -> None:
        old = self.capacity
        self.k = torch.cat([self.k, torch.zeros_like(self.k)])
        self.v = torch.cat([self.v, torch.zeros_like(self.v)])
        self.refs.extend([0] * old)
        self.free.extend(range(2 * old - 1, old - 1, -1))


class PooledKVCache(PagedKVCache):
    """`PagedKVCache` over a `BlockPool`: block i of this sequence is pool block `ids[i]`.

    `table()` gives the ids as int32 [blocks] on the pool's device (kept until they change);
    `read` gathers K/V as [Hkv, T, Dh] for the PyTorch attention path (VERISPEC_TRITON=0)."""

    def __init__(self, pool: BlockPool, *, max_positions: int):
        super().__init__(pool.num_kv_heads, pool.head_dim, key_block=pool.block, max_positions=max_positions)
        self.pool = pool
        self.ids: list[int] = []
        self._table: torch.Tensor | None = None

    def __del__(self):
        for index in getattr(self, "ids", ()):
            self.pool.release(index)

    @property
    def capacity(self) -> int:
        return len(self.ids) * self.key_block

    def nbytes(self) -> int:
        return len(self.ids) * self._block_nbytes()

    def ensure_capacity(self, num_positions: int) -> None:
        while self.capacity < min(num_positions, self.max_capacity):
            self.ids.append(self.pool.alloc())
            self.shared.append(False)
            self._table = None

    def prepare_write(self, start_pos: int, n: int) -> None:
        for block in range(start_pos // self.key_block, (start_pos + n - 1) // self.key_block + 1):
            if self.shared[block]:
                old = self.ids[block]
                self.ids[block] = self.pool.copy(old)
                self.pool.release(old)
                self.shared[block], self._table = False, None

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [n, Hkv, Dh] on the pool's device, for positions start_pos .. + n - 1."""
        self.prepare_write(start_pos, k.shape[0])
        for block, offset, row, m in block_runs(start_pos, k.shape[0], self.key_block):
            index = self.ids[block]
            self.pool.k[index, :, :, offset:offset + m] = k[row:row + m].permute(1, 2, 0)
            self.pool.v[index, :, offset:offset + m] = v[row:row + m].transpose(0, 1)

    def read(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v fp32 [Hkv, T, Dh] gathered copies, position of each slot int64 [T]), on the device."""
        count = -(-num_slots // self.key_block)
        ids = self.table()[:count].long()
        hkv, dh, b = self.num_kv_heads, self.head_dim, self.key_block
        k = self.pool.k[ids].permute(1, 0, 3, 2).reshape(hkv, count * b, dh)
        v = self.pool.v[ids].permute(1, 0, 2, 3).reshape(hkv, count * b, dh)
        return k[:, :num_slots], v[:, :num_slots], torch.arange(num_slots, device=self.pool.device)

    def table(self) -> torch.Tensor:
        """int32 [blocks]: the pool indices of this sequence's blocks, on the pool's device."""
        if self._table is None:
            self._table = torch.tensor(self.ids, dtype=torch.int32).to(self.pool.device)
        return self._table

    def kernel_view(self):
        raise TypeError("a pooled KV cache is read by kernels.triton_attend through table(), not by the C kernels")

    def truncate(self, length: int) -> None:
        count = -(-length // self.key_block)
        for index in self.ids[count:]:
            self.pool.release(index)
        del self.ids[count:], self.shared[count:]
        self._table = None

    def fork(self, length: int) -> "PooledKVCache":
        """A cache sharing this one's blocks up to slot `length` (both mark them shared)."""
        new = copy.copy(self)
        count = min(len(self.ids), -(-length // self.key_block))
        new.ids = self.ids[:count]
        for index in new.ids:
            self.pool.retain(index)
        self.shared[:count] = [True] * count
        new.shared, new._table = [True] * count, None
        new.k_blocks, new.v_blocks = [], []
        return new
