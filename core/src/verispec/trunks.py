"""SpecTrunk: the one face of a trunk the loop talks to, over two KV regimes.

`LinearSpecTrunk` drives a `SpeculativeTarget` with its live contiguous cache. (A
`BatchedSpecTrunk` over a paged cache with per-slot recurrent state implements the same
seam for one slot of a `BatchedSpeculativeTarget`.)

Shape letters: n rows, V vocabulary, F tap width.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from verispec.seams import (BatchedSpeculativeTarget, ContextOverflow, SpeculativeTarget, VerifyOutput,
                            declared)


class SpecTrunk(Protocol):
    """What `SpeculativeExecution` needs: plain steps, one multi-row verify, and rollback."""

    seq_len: int  # committed positions in the cache
    max_context_length: int

    def prefill(self, tokens: Sequence[int], *, hidden: bool) -> VerifyOutput:
        """Append the prompt; logits of the last row [1, V] (+ hidden rows [n, F])."""

    def decode(self, token: int, *, hidden: bool) -> VerifyOutput:
        """One plain step: append `token`, return logits [1, V] (+ its hidden row [1, F])."""

    def verify(self, tokens: Sequence[int], *, hidden: bool) -> VerifyOutput:
        """Append [last, d1..dK] in one forward; logits [K+1, V] (+ hidden [K+1, F])."""

    def rollback(self, base_len: int, tokens: Sequence[int], num_kept: int, *, hidden: bool) -> "torch.Tensor | None":
        """Keep only the first `num_kept` verify rows of `tokens`; return their hidden rows when re-forwarded."""

    def rewind(self, length: int) -> None:
        """Drop everything past `length` (prefix reuse); raises ValueError when state cannot be rewound."""


def _as_ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(tokens), dtype=torch.long)


class LinearSpecTrunk:
    """SpecTrunk over a `SpeculativeTarget` and its contiguous cache.

    Rollback rule (DESIGN §3): when the target declares that its verify persisted usable
    KV and holds no recurrent state, rollback is a rewind; otherwise the recurrent
    snapshot taken before the verify is restored and the kept prefix is re-forwarded.
    """

    def __init__(self, target: SpeculativeTarget):
        if not isinstance(target, SpeculativeTarget):
            raise TypeError(f"{type(target).__name__} does not implement SpeculativeTarget "
                            "(needs forward, spec_forward, spec_rewind_cache, ... see verispec.seams)")
        self.target = target
        self.max_context_length = target.max_context_length
        self._recurrent = declared(target, "spec_has_recurrent_state")
        self._rewind_only = declared(target, "spec_verify_persists_accepted_kv") and not self._recurrent
        self._plain_uses_forward = declared(target, "spec_plain_step_uses_forward")

    @property
    def seq_len(self) -> int:
        return self.target.cache_seq_len

    def _reserve(self, n: int) -> None:
        required = self.seq_len + n
        if required > self.max_context_length:
            raise ContextOverflow(required, self.max_context_length)
        self.target.spec_ensure_capacity(required)

    def prefill(self, tokens: Sequence[int], *, hidden: bool) -> VerifyOutput:
        self._reserve(len(tokens))
        if hidden or not self._plain_uses_forward:
            return self.target.spec_forward(_as_ids(tokens), hidden=hidden, all_logits=False)
        return VerifyOutput(logits=self.target.forward(_as_ids(tokens)).reshape(1, -1))

    def decode(self, token: int, *, hidden: bool) -> VerifyOutput:
        return self.prefill([token], hidden=hidden)

    def verify(self, tokens: Sequence[int], *, hidden: bool) -> VerifyOutput:
        self._reserve(len(tokens))
        if self._recurrent:
            self.target.spec_snapshot_recurrent_state()
        return self.target.spec_forward(_as_ids(tokens), hidden=hidden, all_logits=True)

    def rollback(self, base_len: int, tokens: Sequence[int], num_kept: int, *, hidden: bool):
        on_accepted = getattr(self.target, "spec_on_verify_accepted", None)
        if on_accepted is not None:
            on_accepted(num_kept, len(tokens))
        if num_kept == len(tokens):
            return None
        if self._rewind_only:
            self.target.spec_rewind_cache(base_len + num_kept)
            return None
        self.target.spec_restore_recurrent_state()
        self.target.spec_rewind_cache(base_len)
        if num_kept == 0:
            return None
        out = self.target.spec_forward(_as_ids(tokens[:num_kept]), hidden=hidden, all_logits=False)
        return out.hidden

    def rewind(self, length: int) -> None:
        if self._recurrent and length != self.seq_len:
            raise ValueError("recurrent state cannot be rewound; start from an empty cache")
        self.target.spec_rewind_cache(length)


class BatchedSpecTrunk:
    """SpecTrunk over one slot of a `BatchedSpeculativeTarget` (paged KV + per-slot state).

    The same rollback rule as LinearSpecTrunk, addressed by slot, so speculative and plain
    batched decoding run the same kernels.
    """

    def __init__(self, target: BatchedSpeculativeTarget, slot: int):
        if not isinstance(target, BatchedSpeculativeTarget):
            raise TypeError(f"{type(target).__name__} does not implement BatchedSpeculativeTarget")
        self.target = target
        self.slot = slot
        self.max_context_length = target.max_context_length
        self._recurrent = declared(target, "spec_has_recurrent_state")
        self._rewind_only = declared(target, "spec_verify_persists_accepted_kv") and not self._recurrent

    @property
    def seq_len(self) -> int:
        return self.target.spec_slot_seq_len(self.slot)

    def _forward(self, tokens, *, hidden, all_logits) -> VerifyOutput:
        required = self.seq_len + len(tokens)
        if required > self.max_context_length:
            raise ContextOverflow(required, self.max_context_length)
        return self.target.spec_forward_batch([self.slot], [_as_ids(tokens)], hidden=hidden,
                                              all_logits=all_logits)[0]

    def prefill(self, tokens, *, hidden):
        return self._forward(tokens, hidden=hidden, all_logits=False)

    def decode(self, token, *, hidden):
        return self._forward([token], hidden=hidden, all_logits=False)

    def verify(self, tokens, *, hidden):
        if self._recurrent:
            self.target.spec_snapshot_slot(self.slot)
        return self._forward(tokens, hidden=hidden, all_logits=True)

    def rollback(self, base_len, tokens, num_kept, *, hidden):
        if num_kept == len(tokens):
            return None
        if self._rewind_only:
            self.target.spec_rewind_slot(self.slot, base_len + num_kept)
            return None
        self.target.spec_restore_slot(self.slot)
        self.target.spec_rewind_slot(self.slot, base_len)
        if num_kept == 0:
            return None
        return self._forward(tokens[:num_kept], hidden=hidden, all_logits=False).hidden

    def rewind(self, length):
        if self._recurrent and length != self.seq_len:
            raise ValueError("recurrent state cannot be rewound; start from an empty cache")
        self.target.spec_rewind_slot(self.slot, length)
