"""Position-addressed KV caches: rewinding attention KV is moving an integer, never a copy.

Shape letters: Hkv KV heads, S slots, Dh head dim, n rows written, T slots read.

- `LinearKVCache`: slot = position; buffers grow on demand (`ensure_capacity`).
- `RingKVCache`: a sliding-window layer's ring of S = window + max_rows - 1 slots,
  slot = position mod S, each slot tagged with the position it holds (-1 = empty).
  A forward writes its n <= max_rows rows first and then attends, so the ring must keep
  the window of the *earliest* row while the latest is written: window + n - 1 slots.
  The same slack makes rollback exact: rejected rows only overwrite positions that no
  kept row can see any more (reference/gemma4.md §5: a ring of exactly `window` slots
  corrupts multi-row forwards and rollbacks silently). A model sizes its rings for
  max(its chunk length, the widest verify it accepts: MAX_VERIFY_ROWS by default).
- `ModelKVCache`: the per-layer caches of one model, rewound and reset together.

Reads are by key length: a query at position p reads slots [0, key_length(p)), with
key_length(p) = round_up(p + 1, key_block) capped at the ring size. It depends on p only,
so a row's attention reductions have the same length whether it is computed alone or
inside an n-row verify — the property `attention.attend` relies on for batch invariance.
Buffers are fp32 [Hkv, S, Dh]: contiguous per head, as the per-head bmm wants them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class RewindBeyondWindow(ValueError):
    """A rewind would need sliding-window KV that the ring already overwrote."""

    def __init__(self, length: int, oldest_needed: int, oldest_kept: int):
        self.length, self.oldest_needed, self.oldest_kept = length, oldest_needed, oldest_kept
        super().__init__(
            f"cannot rewind the cache to {length} positions: the sliding-window ring needs position "
            f"{oldest_needed} but only keeps positions from {oldest_kept}; re-forward from an empty "
            "cache (rewind to 0), or load the model with a larger max_verify_rows")


#: the widest verify the loop sends: --spec-draft is 1..64 (DESIGN §5), plus the pending token.
#: A verify longer than a model's chunk is split, but rolls back as one, so rings keep this slack.
MAX_VERIFY_ROWS = 65


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class LinearKVCache(nn.Module):
    """Slot = position. k, v: fp32 [Hkv, S, Dh]; S a multiple of key_block, grown on demand."""

    is_ring = False

    def __init__(self, num_kv_heads: int, head_dim: int, *, key_block: int = 64, max_positions: int):
        super().__init__()
        self.num_kv_heads, self.head_dim, self.key_block = num_kv_heads, head_dim, key_block
        self.max_capacity = _round_up(max_positions, key_block)
        self.register_buffer("k", torch.zeros(num_kv_heads, 0, head_dim), persistent=False)
        self.register_buffer("v", torch.zeros(num_kv_heads, 0, head_dim), persistent=False)
        self.register_buffer("slot_positions", torch.arange(0), persistent=False)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def ensure_capacity(self, num_positions: int) -> None:
        """Room for positions [0, num_positions); grows by doubling (copies the old slots once)."""
        if num_positions <= self.capacity:
            return
        size = min(self.max_capacity, max(_round_up(num_positions, self.key_block), 2 * self.capacity))
        k = torch.zeros(self.num_kv_heads, size, self.head_dim)
        v = torch.zeros_like(k)
        k[:, :self.capacity] = self.k
        v[:, :self.capacity] = self.v
        self.k, self.v, self.slot_positions = k, v, torch.arange(size)

    def key_length(self, pos: int) -> int:
        return _round_up(pos + 1, self.key_block)

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [n, Hkv, Dh] for positions start_pos .. start_pos + n - 1."""
        n = k.shape[0]
        self.k[:, start_pos:start_pos + n] = k.transpose(0, 1)
        self.v[:, start_pos:start_pos + n] = v.transpose(0, 1)

    def read(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v fp32 [Hkv, T, Dh], position held by each slot int64 [T]) for slots [0, T)."""
        return self.k[:, :num_slots], self.v[:, :num_slots], self.slot_positions[:num_slots]

    def check_rewind(self, length: int) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass  # slots past `length` are masked by position and overwritten later

    def reset(self) -> None:
        pass


class RingKVCache(nn.Module):
    """Sliding-window ring. k, v: fp32 [Hkv, S, Dh] with S = window + max_rows - 1; tags int64 [S]."""

    is_ring = True

    def __init__(self, num_kv_heads: int, head_dim: int, *, window: int, max_rows: int, key_block: int = 64):
        super().__init__()
        self.window, self.max_rows, self.key_block = window, max_rows, key_block
        self.size = window + max_rows - 1
        self.register_buffer("k", torch.zeros(num_kv_heads, self.size, head_dim), persistent=False)
        self.register_buffer("v", torch.zeros(num_kv_heads, self.size, head_dim), persistent=False)
        self.register_buffer("tags", torch.full((self.size,), -1, dtype=torch.long), persistent=False)
        self.high_water = -1  # the highest position ever written since reset

    def ensure_capacity(self, num_positions: int) -> None:
        pass  # fixed size

    def key_length(self, pos: int) -> int:
        return min(_round_up(pos + 1, self.key_block), self.size)

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [n, Hkv, Dh], n <= max_rows, for positions start_pos .. start_pos + n - 1."""
        n = k.shape[0]
        if n > self.max_rows:
            raise ValueError(f"{n} rows in one forward, but the ring was sized for {self.max_rows}; "
                             "split the forward (the model does) or load with a larger max_rows_per_forward")
        positions = torch.arange(start_pos, start_pos + n)
        slots = positions % self.size
        self.k.index_copy_(1, slots, k.transpose(0, 1))
        self.v.index_copy_(1, slots, v.transpose(0, 1))
        self.tags.index_copy_(0, slots, positions)
        self.high_water = max(self.high_water, start_pos + n - 1)

    def read(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k[:, :num_slots], self.v[:, :num_slots], self.tags[:num_slots]

    def check_rewind(self, length: int) -> None:
        """Raise RewindBeyondWindow when a query at `length` would need an overwritten position."""
        oldest_needed = max(0, length - self.window + 1)
        oldest_kept = max(0, self.high_water - self.size + 1)
        if length > 0 and oldest_needed < oldest_kept:
            raise RewindBeyondWindow(length, oldest_needed, oldest_kept)

    def rewind(self, length: int) -> None:
        if length == 0:
            self.reset()
        else:
            self.tags.masked_fill_(self.tags >= length, -1)

    def reset(self) -> None:
        self.tags.fill_(-1)
        self.high_water = -1


class ModelKVCache(nn.Module):
    """One model's per-layer caches (None for a layer that stores no KV, e.g. Gemma 4's
    KV-shared layers) and the committed length `seq_len`."""

    def __init__(self, layers: Sequence[nn.Module | None]):
        super().__init__()
        self.layers = list(layers)
        self._modules_list = nn.ModuleList([c for c in layers if c is not None])
        self.seq_len = 0

    def __getitem__(self, layer_idx: int):
        return self.layers[layer_idx]

    def ensure_capacity(self, num_positions: int) -> None:
        for cache in self._modules_list:
            cache.ensure_capacity(num_positions)

    def rewind(self, length: int) -> None:
        """Keep positions [0, length). All rings are checked before any changes, so a refused
        rewind (RewindBeyondWindow) leaves the cache as it was."""
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.seq_len} positions")
        for cache in self._modules_list:
            cache.check_rewind(length)
        for cache in self._modules_list:
            cache.rewind(length)
        self.seq_len = length

    def reset(self) -> None:
        for cache in self._modules_list:
            cache.reset()
        self.seq_len = 0
