"""Per-sequence trunk state, one object per layer, and the sequence bookkeeping of the seam.

A trunk composes its layers' state kinds; `SequenceState` holds one sequence's list of them
and implements `keep` (after a verify) and `truncate` (prefix reuse) once for every kind:

- the KV caches of `nn.kv_cache` (`PagedKVCache`, `RingKVCache`; a draft head's `HeadKVCache`);
- `RecurrentState`: named tensors (a conv tail, a matrix state, ...) replaced row by row.
  During a verify the layer records the state after every row, so `keep(a)` selects the
  state after row a with no re-forward; a full acceptance copies nothing. A recurrent state
  cannot be truncated to an arbitrary prefix (`CannotTruncate`).

`SequenceState.fork(length)` copies a sequence's first `length` positions into a new one
(prefix caching): each kind copies itself (`fork`), then the copy is truncated, so a kind
forks exactly where it can truncate (a recurrent state only at the sequence's full length).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch

from verispec.nn.kv_cache import CannotTruncate, storage_nbytes

__all__ = ["CannotTruncate", "RecurrentState", "SequenceState"]


class RecurrentState:
    """Named recurrent tensors of one layer (e.g. conv tail [C, W-1], matrix state [H, Dk, Dv]).

    The layer reads `values[name]` and, after each forward chunk, calls `update(rows)` with the
    state after every row of the chunk (dict of [n, *shape] tensors; the last row becomes the
    current state). Outside a verify only the last row is held; inside one every row is, so
    `keep(length)` selects the state after row `length - base` (the state before the verify
    when 0) without a re-forward.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype = torch.float32, device=None):
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.dtype, self.device = dtype, device  # device: a placed trunk's (TrunkModule.to_device); None: the CPU
        self.values = self._zeros()
        self._verify_base: int | None = None
        self._before: dict[str, torch.Tensor] | None = None
        self._rows: dict[str, list[torch.Tensor]] = {}

    def _zeros(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=self.dtype, device=self.device) for name, shape in self.shapes.items()}

    def ensure_capacity(self, num_positions: int) -> None:
        pass  # fixed size

    def max_nbytes(self, num_positions: int) -> int:
        """Bytes of the state at any length: its fixed size. Not counted: the per-row states a
        verify records until `keep` (up to MAX_VERIFY_ROWS copies, while the verify lasts), nor a
        bigger storage that a kept row is a view of (`nbytes` counts that)."""
        return sum(self.dtype.itemsize * math.prod(shape) for shape in self.shapes.values())

    def nbytes(self) -> int:
        """Bytes held now: the storages of the values and, during a verify, of the state before it
        and the rows it recorded."""
        return storage_nbytes([*self.values.values(), *(self._before or {}).values(),
                               *(t for rows in self._rows.values() for t in rows)])

    def begin(self, seq_len: int, verify: bool) -> None:
        """Called by SequenceState before each forward of this sequence."""
        self._verify_base = seq_len if verify else None
        self._before = dict(self.values) if verify else None
        self._rows = {name: [] for name in self.shapes} if verify else {}

    def update(self, rows: Mapping[str, torch.Tensor]) -> None:
        """rows: name -> state after each row of this chunk [n, *shape] (new tensors, never views of
        `values` mutated later)."""
        for name, per_row in rows.items():
            if self._verify_base is not None:
                self.values[name] = per_row[-1]
                self._rows[name].append(per_row)
            else:  # a view of a many-row chunk would keep all its rows alive (max_nbytes counts one)
                self.values[name] = per_row[-1] if len(per_row) == 1 else per_row[-1].clone()

    def check_keep(self, length: int) -> None:
        pass  # every row's state was recorded

    def keep(self, length: int) -> None:
        index = length - self._verify_base  # rows kept, 0..n; n (full acceptance) copies nothing
        if index == 0:
            self.values = dict(self._before)
        else:
            for name, chunks in self._rows.items():
                row = index - 1
                for per_row in chunks:  # a verify longer than a forward chunk arrives in pieces
                    if row < len(per_row):
                        self.values[name] = per_row[row]
                        break
                    row -= len(per_row)
        self._verify_base, self._before, self._rows = None, None, {}

    def check_truncate(self, length: int) -> None:
        raise CannotTruncate(f"recurrent state holds the whole history in a fixed-size summary; it cannot be cut "
                             f"back to {length} tokens: start a new sequence and prefill it")

    def truncate(self, length: int) -> None:
        self.values = self._zeros()  # SequenceState calls this with 0 only (check_truncate refuses the rest)

    def fork(self, length: int) -> "RecurrentState":
        """A copy of the current state (SequenceState forks it only at the sequence's full length, or 0)."""
        new = copy.copy(self)
        new.values = {name: value.clone() for name, value in self.values.items()}
        new._verify_base, new._before, new._rows = None, None, {}
        return new


class SequenceState:
    """One sequence's per-layer states (None for a layer that stores nothing, e.g. a KV-shared
    layer) and its committed length `seq_len`; remembers the last verify for `keep`."""

    def __init__(self, layers: Sequence[object | None]):
        self.layers = list(layers)
        self._states = [s for s in self.layers if s is not None]
        self.seq_len = 0
        self.verify_rows: int | None = None  # rows of the last forward when it was a verify

    def begin(self, num_rows: int, *, verify: bool) -> int:
        """Prepare a forward of `num_rows` rows; returns the position of its first row."""
        for state in self._states:
            state.ensure_capacity(self.seq_len + num_rows)
            state.begin(self.seq_len, verify)
        self.verify_rows = num_rows if verify else None
        return self.seq_len

    def max_nbytes(self, num_positions: int) -> int:
        """Bytes this sequence's states may hold at `num_positions` positions (each kind's
        `max_nbytes`; a state object shared by several layers counts once)."""
        return sum(state.max_nbytes(num_positions) for state in self._unique_states())

    def nbytes(self) -> int:
        """Bytes this sequence's states hold now."""
        return sum(state.nbytes() for state in self._unique_states())

    def _unique_states(self) -> list:
        return list({id(state): state for state in self._states}.values())

    def keep(self, num_rows: int) -> None:
        """Commit the first `num_rows` rows of the last verify; raises ValueError without one, and
        RewindBeyondWindow (changing nothing) when a ring's slack was narrower than the verify."""
        if self.verify_rows is None:
            raise ValueError("keep() needs a verify: the sequence's last forward was not marked verify=True")
        if not 0 <= num_rows <= self.verify_rows:
            raise ValueError(f"keep({num_rows}): the last verify had {self.verify_rows} rows")
        length = self.seq_len - self.verify_rows + num_rows
        for state in self._states:  # every layer agrees before any changes
            state.check_keep(length)
        for state in self._states:
            state.keep(length)
        self.seq_len, self.verify_rows = length, None

    def fork(self, length: int) -> "SequenceState":
        """A new SequenceState holding copies of this one's first `length` positions (this one is
        unchanged). Raises CannotTruncate (copying nothing) where `truncate(length)` would."""
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot fork {length} positions: the sequence holds {self.seq_len}")
        if 0 < length < self.seq_len:
            for state in self._states:
                state.check_truncate(length)
        new = SequenceState([None if state is None else state.fork(length) for state in self.layers])
        new.seq_len = self.seq_len
        new.truncate(length)
        return new

    def truncate(self, length: int) -> None:
        """Cut back to the first `length` positions (prefix reuse). 0 always works; otherwise
        raises CannotTruncate (RewindBeyondWindow for a ring) and changes nothing."""
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot truncate to {length}: the sequence holds {self.seq_len} positions")
        if length == self.seq_len:
            self.verify_rows = None  # the last verify, if any, is committed whole
            return
        if length:
            for state in self._states:
                state.check_truncate(length)
        for state in self._states:
            state.truncate(length)
        self.seq_len, self.verify_rows = length, None
