"""The drafter's own context K/V of one sequence and one layer: `ContextRing` (reference note §6).

Rows are the Pass B K/V of committed target positions (never block rows). Slot of position p:
`p mod R`; R = W + B for a sliding-window layer (W the window, B the block size: the B extra rows
let a caller inject a whole verify batch and roll it back without losing a row the next block
sees; the note's R = W suffices when only committed rows are written), the trunk's context
length for a full layer (a linear cache: no wrap). A full layer's storage grows on demand (doubling), so a
short sequence does not hold `max_context` rows.

Visibility for Pass C at anchor position s, query row i at position q_i = s + i (note §6):
slot j is visible iff `pos[j] >= 0 and pos[j] < s and (full layer or q_i - pos[j] < W)`.
Stale rows are harmless through `pos < s`; a rewind to length L still empties every slot with
`pos >= L` (`drop_from`), so a ring after a rollback equals one filled afresh.
"""
from __future__ import annotations

import torch


class ContextRing:
    """K/V rows fp32 [slots, n_kv, d] with each slot's absolute position int64 [slots] (-1 = empty).

    capacity: R (rows before a slot is reused). window: W for a sliding-window layer (R >= W), None
    for a full layer.
    """

    def __init__(self, capacity: int, num_kv_heads: int, head_dim: int, window: int | None):
        if capacity < 1 or (window is not None and capacity < window):
            raise ValueError(f"a context ring needs at least one slot and its window {window}, got {capacity}")
        self.capacity, self.window = capacity, window
        self._shape = (num_kv_heads, head_dim)
        size = capacity if window is not None else min(capacity, 64)
        self.k = torch.zeros(size, *self._shape)
        self.v = torch.zeros(size, *self._shape)
        self.pos = torch.full((size,), -1, dtype=torch.long)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v fp32 [n, n_kv, d] at ascending absolute positions int64 [n] (< capacity
        for a full layer: raises ValueError past it). A batch longer than R keeps its newest R rows."""
        if positions.numel() > self.capacity:
            positions, k, v = positions[-self.capacity:], k[-self.capacity:], v[-self.capacity:]
        if self.window is None:
            last = int(positions[-1])
            if last >= self.capacity:
                raise ValueError(f"position {last} is past the drafter's {self.capacity}-row context cache")
            self._grow(last + 1)
        slots = positions % self.capacity
        self.k[slots], self.v[slots], self.pos[slots] = k, v, positions

    def drop_from(self, length: int) -> None:
        """Empty every slot holding a position >= length (a rollback or rewind to `length`)."""
        self.pos[self.pos >= length] = -1

    def visible(self, anchor: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows Pass C at anchor position `anchor` may read: k, v fp32 [m, n_kv, d] and the
        mask bool [num_rows, m] (True = query row i sees slot j), m = slots holding a position < anchor."""
        held = (self.pos >= 0) & (self.pos < anchor)
        index = held.nonzero().reshape(-1)
        pos = self.pos[index]
        mask = torch.ones(num_rows, index.numel(), dtype=torch.bool)
        if self.window is not None:
            queries = anchor + torch.arange(num_rows)
            mask = (queries[:, None] - pos[None, :]) < self.window
        return self.k[index], self.v[index], mask

    def held_positions(self) -> torch.Tensor:
        """int64 [m]: the positions the ring holds, ascending."""
        return torch.sort(self.pos[self.pos >= 0]).values

    def rows_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v fp32 [n, n_kv, d] stored for `positions` (which the ring must hold)."""
        slots = positions % self.capacity
        if not torch.equal(self.pos[slots], positions):
            raise KeyError(f"the ring does not hold positions {positions.tolist()}")
        return self.k[slots], self.v[slots]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.pos.nbytes

    def _grow(self, needed: int) -> None:
        size = self.pos.numel()
        if needed <= size:
            return
        new = min(self.capacity, max(needed, 2 * size))
        self.k = torch.cat([self.k, torch.zeros(new - size, *self._shape)])
        self.v = torch.cat([self.v, torch.zeros(new - size, *self._shape)])
        self.pos = torch.cat([self.pos, torch.full((new - size,), -1, dtype=torch.long)])
