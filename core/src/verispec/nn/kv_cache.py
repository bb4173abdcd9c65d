"""The attention state kinds: KV caches a layer (or a draft head) writes and reads by position.

- `PagedKVCache`: attention K/V, slot = position, in fixed-size blocks allocated as the
  sequence grows (a block table per sequence); forks share blocks, copied on write. Keeping
  is moving the committed length: slots past it are masked by position.
- `RingKVCache`: a sliding-window layer's ring of S = window + max_rows - 1 slots,
  slot = position mod S, each slot tagged with the position it holds (-1 = empty).
  A forward writes its n <= max_rows rows first and then attends, so the ring must keep
  the window of the *earliest* row while the latest is written: window + n - 1 slots.
  The same slack makes `keep` exact with no copy: rejected rows only overwrite positions
  that no kept row can see any more (a ring of exactly `window` slots corrupts multi-row
  forwards and rollbacks silently). A model sizes its rings for max(its chunk length, the
  widest verify it accepts: MAX_VERIFY_ROWS by default).
- `HeadKVCache`: a per-token draft head's own KV (slot = position, grown on demand), whose
  entries may be written with gaps and dropped from a position on.

KV reads are by key length: a query at position p reads slots [0, key_length(p)), with
key_length(p) = round_up(p + 1, key_block) capped at the ring size. It depends on p only,
so a row's attention reductions have the same length whether it is computed alone or
inside an n-row verify — the property `attention.attend` relies on for batch invariance.
K is stored transposed, fp32 [Hkv, Dh, slots], V as fp32 [Hkv, slots, Dh] (`kernels.ckernels`'s
layout); `read` gives both as [Hkv, T, Dh].

Shape letters: Hkv KV heads, S slots, Dh head dim, n rows written, T slots read.
"""

from __future__ import annotations

import copy

import torch

from verispec.seams import MAX_DRAFT_TOKENS


class CannotTruncate(ValueError):
    """The sequence's state cannot be cut back to that prefix (recurrent state, an old ring)."""


class RewindBeyondWindow(CannotTruncate):
    """A truncation would need sliding-window KV that the ring already overwrote."""

    def __init__(self, length: int, oldest_needed: int, oldest_kept: int):
        self.length, self.oldest_needed, self.oldest_kept = length, oldest_needed, oldest_kept
        super().__init__(
            f"cannot truncate the sequence to {length} positions: the sliding-window ring needs position "
            f"{oldest_needed} but only keeps positions from {oldest_kept}; start a new sequence, or load "
            "the model with a larger max_verify_rows")


#: the widest verify the loop sends: MAX_DRAFT_TOKENS drafts plus the pending token.
#: A verify longer than a model's chunk is split, but kept as one, so rings keep this slack.
MAX_VERIFY_ROWS = MAX_DRAFT_TOKENS + 1


def block_runs(start_pos: int, n: int, key_block: int):
    """The runs of positions start_pos .. start_pos + n - 1 that fall in one block each: yields
    (block, offset in it, first row, rows) in order."""
    row = 0
    while row < n:
        block, offset = divmod(start_pos + row, key_block)
        m = min(key_block - offset, n - row)
        yield block, offset, row, m
        row += m


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def storage_nbytes(tensors) -> int:
    """Bytes of the storages these tensors keep alive, each storage counted once (a view of a
    bigger tensor keeps all of it: a recurrent row selected from a verify's stack, say)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


class PagedKVCache:
    """Slot = position, held in fixed-size blocks: block i holds slots [i·B, (i+1)·B), B = key_block.

    The block table (`k_blocks`, `v_blocks`) grows one block at a time, so memory follows the
    sequence's length. `fork` shares the blocks (prefix caching copies nothing); a block held by
    more than one sequence is copied before either writes into it. Per block: keys transposed
    fp32 [Hkv, Dh, B] (the attention kernel's layout: scores run along the slots), values fp32
    [Hkv, B, Dh].
    """

    #: caches with equal keys hold the same position in every slot they both have, so the
    #: layers of one forward share one visibility mask (`attention.attend`): slot = position here.
    mask_key = ("linear",)

    def __init__(self, num_kv_heads: int, head_dim: int, *, key_block: int = 64, max_positions: int):
        self.num_kv_heads, self.head_dim, self.key_block = num_kv_heads, head_dim, key_block
        self.max_capacity = _round_up(max_positions, key_block)
        self.k_blocks: list[torch.Tensor] = []
        self.v_blocks: list[torch.Tensor] = []
        self.shared: list[bool] = []  # block i is also in another sequence's table: copy before writing
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # blocks' data pointers, for the kernel

    @property
    def capacity(self) -> int:
        return len(self.k_blocks) * self.key_block

    def _block_nbytes(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.key_block * 4

    def max_nbytes(self, num_positions: int) -> int:
        """Bytes of K/V blocks once this cache has room for `num_positions` positions (exact: it
        holds ceil(num_positions / key_block) blocks, capped at max_capacity)."""
        return _round_up(min(num_positions, self.max_capacity), self.key_block) // self.key_block * self._block_nbytes()

    def nbytes(self) -> int:
        """Bytes held now (a block shared with another sequence counts in both)."""
        return storage_nbytes(self.k_blocks + self.v_blocks)

    def ensure_capacity(self, num_positions: int) -> None:
        """Room for positions [0, num_positions), at most max_capacity: appends zeroed blocks."""
        while self.capacity < min(num_positions, self.max_capacity):
            self.k_blocks.append(torch.zeros(self.num_kv_heads, self.head_dim, self.key_block))
            self.v_blocks.append(torch.zeros(self.num_kv_heads, self.key_block, self.head_dim))
            self.shared.append(False)
            self._tables = None

    def begin(self, seq_len: int, verify: bool) -> None:
        pass  # a verify's rows land exactly where decodes would put them

    def key_length(self, pos: int) -> int:
        return _round_up(pos + 1, self.key_block)

    def prepare_write(self, start_pos: int, n: int) -> None:
        """Before positions start_pos .. start_pos + n - 1 are written (here or by the attention
        kernel): a shared block among them is copied first (the other holder keeps the old one)."""
        for block in range(start_pos // self.key_block, (start_pos + n - 1) // self.key_block + 1):
            if self.shared[block]:
                self.k_blocks[block], self.v_blocks[block] = self.k_blocks[block].clone(), self.v_blocks[block].clone()
                self.shared[block], self._tables = False, None

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [n, Hkv, Dh] for positions start_pos .. start_pos + n - 1."""
        self.prepare_write(start_pos, k.shape[0])
        for block, offset, row, m in block_runs(start_pos, k.shape[0], self.key_block):
            self.k_blocks[block][:, :, offset:offset + m] = k[row:row + m].permute(1, 2, 0)
            self.v_blocks[block][:, offset:offset + m] = v[row:row + m].transpose(0, 1)

    def read(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v fp32 [Hkv, T, Dh], position held by each slot int64 [T]) for slots [0, T): views of
        one block, else copies gathered from the blocks (the PyTorch attention path)."""
        count = -(-num_slots // self.key_block)
        if count == 1:
            k, v = self.k_blocks[0].transpose(1, 2), self.v_blocks[0]
        else:  # one copy each, keys back to [T, Dh] rows (the layout the PyTorch path's bmm wants)
            k = torch.cat([block.transpose(1, 2) for block in self.k_blocks[:count]], dim=1)
            v = torch.cat(self.v_blocks[:count], dim=1)
        return k[:, :num_slots], v[:, :num_slots], torch.arange(num_slots)

    def kernel_view(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """(k table, v table: int64 data pointers of the blocks [blocks], block size, None: slot =
        position) for `ckernels`; the tables stay valid until the next write or growth."""
        if self._tables is None:
            self._tables = (torch.tensor([b.data_ptr() for b in self.k_blocks], dtype=torch.int64),
                            torch.tensor([b.data_ptr() for b in self.v_blocks], dtype=torch.int64))
        return *self._tables, self.key_block, None

    def check_truncate(self, length: int) -> None:
        pass

    def keep(self, length: int) -> None:
        pass  # slots past `length` are masked by position and overwritten later

    def truncate(self, length: int) -> None:
        """Drop the blocks past `length` (slots past it within the last block are masked)."""
        count = -(-length // self.key_block)
        del self.k_blocks[count:], self.v_blocks[count:], self.shared[count:]
        self._tables = None

    check_keep = check_truncate

    def fork(self, length: int) -> "PagedKVCache":
        """A cache sharing this one's blocks up to slot `length` (no copy: both mark them shared)."""
        new = copy.copy(self)
        count = min(len(self.k_blocks), -(-length // self.key_block))
        new.k_blocks, new.v_blocks = self.k_blocks[:count], self.v_blocks[:count]
        self.shared[:count] = [True] * count
        new.shared, new._tables = [True] * count, None
        return new


class RingKVCache:
    """Sliding-window ring: keys transposed fp32 [Hkv, Dh, S], values fp32 [Hkv, S, Dh] with
    S = window + max_rows - 1; tags int64 [S]."""

    def __init__(self, num_kv_heads: int, head_dim: int, *, window: int, max_rows: int, key_block: int = 64):
        self.window, self.max_rows, self.key_block = window, max_rows, key_block
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.size = window + max_rows - 1
        self.k_t = torch.zeros(num_kv_heads, head_dim, self.size)
        self.v = torch.zeros(num_kv_heads, self.size, head_dim)
        self.tags = torch.full((self.size,), -1, dtype=torch.long)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.high_water = -1  # the highest position ever written since the sequence began
        # Every ring of a sequence gets the same writes, keeps and truncations, so rings of one
        # size hold equal tags (a layer writes before it attends) and may share a mask.
        self.mask_key = ("ring", self.size)

    def ensure_capacity(self, num_positions: int) -> None:
        pass  # fixed size

    def max_nbytes(self, num_positions: int) -> int:
        """Bytes (k, v, tags) at any length: the ring's fixed size."""
        return sum(t.numel() * t.element_size() for t in (self.k_t, self.v, self.tags))

    def nbytes(self) -> int:
        return storage_nbytes([self.k_t, self.v, self.tags])

    def begin(self, seq_len: int, verify: bool) -> None:
        pass  # the ring's slack keeps what rejected rows overwrite out of every kept row's window

    def key_length(self, pos: int) -> int:
        return min(_round_up(pos + 1, self.key_block), self.size)

    def prepare_write(self, start_pos: int, n: int) -> torch.Tensor:
        """Before positions start_pos .. start_pos + n - 1 (n <= max_rows) are written (here or by
        the attention kernel): tags their slots, which it returns (int64 [n])."""
        if n > self.max_rows:
            raise ValueError(f"{n} rows in one forward, but the ring was sized for {self.max_rows}; "
                             "split the forward (the model does) or load with a larger max_rows_per_forward")
        positions = torch.arange(start_pos, start_pos + n)
        slots = positions % self.size
        self.tags.index_copy_(0, slots, positions)
        self.high_water = max(self.high_water, start_pos + n - 1)
        return slots

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [n, Hkv, Dh], n <= max_rows, for positions start_pos .. start_pos + n - 1."""
        slots = self.prepare_write(start_pos, k.shape[0])
        self.k_t.index_copy_(2, slots, k.permute(1, 2, 0))
        self.v.index_copy_(1, slots, v.transpose(0, 1))

    def read(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v fp32 [Hkv, T, Dh] views, position held by each slot int64 [T], -1 = empty)."""
        return self.k_t[:, :, :num_slots].transpose(1, 2), self.v[:, :num_slots], self.tags[:num_slots]

    def kernel_view(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """(k table, v table: int64 data pointers [1], block size S: the ring is one block, tags)."""
        if self._tables is None:
            self._tables = (torch.tensor([self.k_t.data_ptr()]), torch.tensor([self.v.data_ptr()]))
        return *self._tables, self.size, self.tags

    def check_truncate(self, length: int) -> None:
        """Raise RewindBeyondWindow when a query at `length` would need an overwritten position."""
        oldest_needed = max(0, length - self.window + 1)
        oldest_kept = max(0, self.high_water - self.size + 1)
        if length > 0 and oldest_needed < oldest_kept:
            raise RewindBeyondWindow(length, oldest_needed, oldest_kept)

    def truncate(self, length: int) -> None:
        self.tags.masked_fill_(self.tags >= length, -1)
        if length == 0:
            self.high_water = -1

    # After a verify: one wider than the ring's slack (max_rows) is refused here, loudly.
    check_keep, keep = check_truncate, truncate

    def fork(self, length: int) -> "RingKVCache":
        """A copy of the whole ring (the caller truncates it to `length`)."""
        new = copy.copy(self)
        new.k_t, new.v, new.tags = self.k_t.clone(), self.v.clone(), self.tags.clone()
        new._tables = None
        return new



class HeadKVCache:
    """The head's KV: slot = position, fp32 [Hkv, S, Dh]; a slot holds a position only once written
    (positions of a gap or of dropped provisional rows read as empty, -1). Grows on demand."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.k = torch.zeros(num_kv_heads, 0, head_dim)
        self.v = torch.zeros(num_kv_heads, 0, head_dim)
        self.tags = torch.full((0,), -1, dtype=torch.long)

    def key_length(self, pos: int) -> int:
        return pos + 1

    def write(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: fp32 [m, Hkv, Dh] for positions start_pos .. start_pos + m - 1."""
        end = start_pos + k.shape[0]
        if end > self.k.shape[1]:
            size = max(end, 2 * self.k.shape[1], 64)
            grow = size - self.k.shape[1]
            self.k = torch.cat([self.k, self.k.new_zeros(self.k.shape[0], grow, self.k.shape[2])], dim=1)
            self.v = torch.cat([self.v, self.v.new_zeros(self.v.shape[0], grow, self.v.shape[2])], dim=1)
            self.tags = torch.cat([self.tags, self.tags.new_full((grow,), -1)])
        self.k[:, start_pos:end] = k.transpose(0, 1)
        self.v[:, start_pos:end] = v.transpose(0, 1)
        self.tags[start_pos:end] = torch.arange(start_pos, end)

    def read(self, num_slots: int):
        return self.k[:, :num_slots], self.v[:, :num_slots], self.tags[:num_slots]

    def drop_from(self, pos: int) -> None:
        """Forget every entry at position >= pos."""
        self.tags[pos:] = -1
