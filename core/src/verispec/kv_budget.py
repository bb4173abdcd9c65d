"""KVBudget: the KV/state memory running and idle sequences may occupy together.

A request reserves the bytes its sequence may grow to (`trunk.sequence_nbytes` of prompt +
max_tokens + the widest verify) while it runs; running reservations plus the bytes idle
(prefix-cache) sequences hold stay within the budget. The scheduler admits the head of its
queue (FIFO) only once its reservation fits, idle sequences released first, least recently used
first; a request whose reservation alone exceeds the budget fails with InvalidArgument. A trunk
without `sequence_nbytes` (seams.declared) is not budgeted.
"""
from __future__ import annotations

import math

from verispec.errors import InvalidArgument
from verispec.nn.kv_cache import MAX_VERIFY_ROWS
from verispec.seams import declared


class KVBudget:
    """Reservations of running requests against `budget_bytes` (None = no budget), with the idle
    sequences of `prefix_cache` (verispec.prefix_cache.PrefixCache) counted and released to make room.

    Raises InvalidArgument when `budget_bytes` < 1, or cannot hold the smallest request (one
    prompt token, max_tokens 1).
    """

    def __init__(self, trunk, budget_bytes: int | None, prefix_cache):
        if budget_bytes is not None and budget_bytes < 1:
            raise InvalidArgument(f"kv_budget_bytes={budget_bytes}: choose >= 1, or None for no budget")
        self.trunk, self.budget_bytes, self.prefix_cache = trunk, budget_bytes, prefix_cache
        # the trunk's memory declarations (seams), read once: None = not budgeted / estimated
        self._sequence_nbytes = declared(trunk, "sequence_nbytes")
        self._held_nbytes = declared(trunk, "sequence_held_nbytes")
        self._reservations: dict[object, int] = {}  # running request -> bytes reserved for its sequence
        smallest = self.smallest_reservation() if budget_bytes is not None else None
        if smallest is not None and smallest > budget_bytes:
            raise InvalidArgument(
                f"a KV budget of {budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB) cannot hold one "
                f"sequence: the smallest request (1 prompt token, max_tokens 1) reserves {smallest} bytes; raise "
                f"--kv-cache-gb (kv_cache_gb=) to at least {math.ceil(smallest / 2**30 * 1e4) / 1e4:g}, or 0 for no budget")

    @property
    def budgeted(self) -> bool:
        """A budget is set and the trunk declares what a sequence occupies."""
        return self.budget_bytes is not None and self._sequence_nbytes is not None

    def reservation(self, num_prompt_tokens: int, max_tokens: int, max_context_length: int) -> int | None:
        """Bytes a request reserves while it runs: its sequence at prompt + max_tokens + the widest
        verify positions (at most the context), or None when nothing is budgeted. Raises
        InvalidArgument (its `param` names the request field to change, or None) when that alone
        exceeds the budget (it could never be admitted)."""
        if not self.budgeted:
            return None
        positions = min(num_prompt_tokens + max_tokens + MAX_VERIFY_ROWS, max_context_length)
        need = self._sequence_nbytes(positions)
        if need <= self.budget_bytes:
            return need
        room = self._max_budgeted_positions(max_context_length) - MAX_VERIFY_ROWS - num_prompt_tokens
        fix = (f"ask for at most max_tokens {room}" if room >= 1 else
               f"shorten the prompt to at most {room + num_prompt_tokens - 1} tokens")
        error = InvalidArgument(
            f"this request may need {need} bytes ({need / 2**20:.2f} MiB) of KV/state memory for "
            f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens}, more than the whole KV budget of "
            f"{self.budget_bytes} bytes ({self.budget_bytes / 2**20:.2f} MiB); {fix}, or raise the budget "
            "(--kv-cache-gb, or kv_cache_gb= in verispec.load)")
        error.param = "max_tokens" if room >= 1 else None  # the request field to change (the server's 400)
        raise error

    def fits(self, reservation: int) -> bool:
        """The running reservations and `reservation` fit in the budget (idle sequences not counted)."""
        return self.reserved_bytes + reservation <= self.budget_bytes

    def reserve(self, request, reservation: int | None) -> None:
        if reservation is not None:
            self._reservations[request] = reservation

    def free(self, request) -> None:
        """The request left: its reservation is returned."""
        self._reservations.pop(request, None)

    def smallest_reservation(self) -> int | None:
        """What a one-token prompt with max_tokens 1 reserves, or None when nothing is budgeted."""
        if self._sequence_nbytes is None:
            return None
        return self._sequence_nbytes(min(2 + MAX_VERIFY_ROWS, self.trunk.max_context_length))

    def _max_budgeted_positions(self, max_context_length: int) -> int:
        """The most positions one sequence may reach within the whole budget (0 if none): a
        binary search, as sequence_nbytes never shrinks with more positions."""
        low, high = 0, max_context_length
        while low < high:
            mid = (low + high + 1) // 2
            if self._sequence_nbytes(mid) <= self.budget_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    @property
    def reserved_bytes(self) -> int:
        """Bytes the running requests reserved."""
        return sum(list(self._reservations.values()))

    @property
    def idle_bytes(self) -> int:
        """Bytes the idle (prefix-cache) sequences hold (0 when the trunk is not budgeted). Safe to
        read from another thread than the stepping one (/metrics): a sequence released meanwhile
        counts 0."""
        total = 0
        for seq in self.prefix_cache.sequences():
            try:
                total += self._idle_nbytes(seq)
            except ValueError:  # released by the stepping thread since the list was taken
                pass
        return total

    def _idle_nbytes(self, seq: int) -> int:
        if self._held_nbytes is not None:
            return self._held_nbytes(seq)
        if self._sequence_nbytes is None:
            return 0
        return self._sequence_nbytes(min(self.trunk.seq_len(seq) + MAX_VERIFY_ROWS, self.trunk.max_context_length))

    def make_room(self, need: int, keep: int | None = None) -> int:
        """Release idle sequences, least recently used first and `keep` (not counted) last, until
        the reservations, the idle sequences and `need` bytes fit in the budget; returns how many
        were released."""
        if not self.budgeted:
            return 0
        released = 0
        while len(self.prefix_cache):
            idle = sum(self._idle_nbytes(seq) for seq in self.prefix_cache.sequences() if seq != keep)
            if self.reserved_bytes + idle + need <= self.budget_bytes:
                break
            victim = next((seq for seq in self.prefix_cache.sequences() if seq != keep), keep)
            keep = None if victim == keep else keep
            self.prefix_cache.release(victim)
            released += 1
        return released
