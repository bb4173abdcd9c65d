"""PrefixCache: finished sequences kept idle with the tokens they hold, for prefix reuse.

A finished request's sequence is kept idle (at most `max_idle_sequences`, least recently used
released first). A new request starts from the longest prefix it shares with an idle or a
running sequence and prefills only the rest: it takes over an idle sequence it continues whole
(the next chat turn), and otherwise forks the prefix (`trunk.fork`), the source left as it was.
A fork copies no paged KV: both sequences share the prefix's blocks, and a shared block is copied
only when one of them writes into it (copy-on-write, nn.kv_cache.PagedKVCache); a sliding-window
ring and a recurrent state, both of fixed size, are copied whole. A trunk whose state cannot be
cut back (recurrent) reuses only a whole sequence.

The scheduler owns one; the KV budget (verispec.kv_budget) releases its idle sequences, least
recently used first, to make room.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

from verispec.nn.state import CannotTruncate


class PrefixCache:
    """The idle sequences of `trunk` (seams.Trunk) and the tokens each holds.

    max_idle_sequences: sequences kept at most (0 = no prefix cache: every finished sequence is
    released).
    """

    def __init__(self, trunk, max_idle_sequences: int):
        self.trunk = trunk
        self.max_idle_sequences = max_idle_sequences
        self._idle: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # seq -> tokens held

    def __len__(self) -> int:
        return len(self._idle)

    def sequences(self) -> list[int]:
        """The idle sequences, least recently used first (a copy: safe to read from another thread)."""
        return list(self._idle)

    def tokens(self, seq: int) -> list[int]:
        """The tokens the idle sequence `seq` holds."""
        return self._idle[seq]

    def reuse(self, ids: list[int], running: Iterable[tuple[int, list[int]]]) -> tuple[int, int]:
        """(sequence, reused tokens) for a prompt: the longest prefix it shares with an idle or a
        running sequence (`running`: (sequence, the tokens it holds)); at least its last token is
        left to forward. Otherwise a new sequence and 0.

        An idle sequence the prompt continues whole is taken over (nothing is lost); any other
        source is forked: the new sequence shares its prefix (copy-on-write) and the source stays
        as it is.
        """
        best, common = None, 0
        for seq, tokens in self._candidates(running):
            n = common_prefix(tokens, ids, limit=len(ids) - 1)
            if n > common:
                best, common = seq, n
        if best is None:
            return self.trunk.new_sequence(), 0
        if len(self._idle.get(best, ())) == common:
            del self._idle[best]
            return best, common
        try:
            return self.trunk.fork(best, common), common
        except CannotTruncate:  # e.g. recurrent state: only a whole sequence can be continued
            return self.trunk.new_sequence(), 0

    def continued(self, ids: list[int]) -> int | None:
        """The idle sequence with the longest history that `ids` continues whole (`reuse` takes it
        over), or None."""
        best, longest = None, 0
        for seq, tokens in self._idle.items():
            if longest < len(tokens) < len(ids) and ids[:len(tokens)] == tokens:
                best, longest = seq, len(tokens)
        return best

    def park(self, seq: int, tokens: list[int]) -> None:
        """Keep a finished sequence idle with the tokens it holds (released at once when the cache
        holds nothing); the least recently used beyond `max_idle_sequences` are released."""
        if self.max_idle_sequences == 0:
            self.trunk.release(seq)
            return
        self._idle[seq] = tokens
        while len(self._idle) > self.max_idle_sequences:
            self.trunk.release(self._idle.popitem(last=False)[0])

    def release(self, seq: int) -> None:
        """Release one idle sequence."""
        del self._idle[seq]
        self.trunk.release(seq)

    def clear(self) -> None:
        """Release every idle sequence."""
        while self._idle:
            self.trunk.release(self._idle.popitem(last=False)[0])

    def _candidates(self, running: Iterable[tuple[int, list[int]]]) -> Iterator[tuple[int, list[int]]]:
        yield from self._idle.items()
        yield from running


def common_prefix(a: list[int], b: list[int], limit: int, block: int = 64) -> int:
    """Length of the common prefix of a and b, at most `limit`: whole blocks compared as list
    slices (C speed), then token by token inside the first block that differs."""
    limit = min(limit, len(a), len(b))
    n = 0
    while n + block <= limit and a[n:n + block] == b[n:n + block]:
        n += block
    while n < limit and a[n] == b[n]:
        n += 1
    return n