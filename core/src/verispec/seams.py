"""The seams between the loop and what plugs into it (DESIGN.md §3).

Shape letters: n rows in a forward, V vocabulary, F feature width of the hidden tap
(`spec_feature_size`), K draft window.

- `SpeculativeTarget`: what the loop needs from a trunk (the model being served).
- `DraftHead` (+ `DraftHeadKind`): a thin adapter over drafter weights bound to one trunk.
- `Speculator`: a drafting algorithm; `DraftContext` is everything it may read per step.
- `VerifyOutput`: what one multi-row trunk forward returns.

No loop lives here: `execution.SpeculativeExecution` is the one implementation.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # torch is imported lazily: `verispec plugins` must not load it
    import torch


class ContextOverflow(ValueError):
    """A forward would write past the trunk's `max_context_length`."""

    def __init__(self, required_len: int, max_context_length: int):
        self.required_len = required_len
        self.max_context_length = max_context_length
        super().__init__(
            f"need {required_len} positions but the context holds {max_context_length}; "
            "shorten the prompt, lower --max-tokens, or load the model with a larger --context-length")


class UnsupportedTap(ValueError):
    """The trunk cannot serve the hidden-state tap a drafter asked for."""


@attrs.frozen
class VerifyOutput:
    #: fp32 [n, V] (or [1, V] when only the last row was asked for).
    logits: "torch.Tensor"
    #: tapped rows [n, F] in the trunk's dtype, or None when not asked for.
    hidden: "torch.Tensor | None" = None


# Declarations a target may override; the loop reads them through `declared()`.
TARGET_DECLARATIONS: dict[str, Any] = {
    # Correctness verdict: non-None makes every layer decline speculation and decode plainly.
    "speculation_refusal": None,
    # Speed verdict: False makes `auto` decline (an explicit --spec-type still runs).
    "speculation_profitable": True,
    # Narrows the *default* draft window only, never an explicit --spec-draft.
    "spec_preferred_draft_window": None,
    # True: the verify left usable KV for accepted rows, so rollback is a rewind only.
    "spec_verify_persists_accepted_kv": True,
    # True: plain (parked / no-draft) steps use `forward`, not a one-row `spec_forward`.
    "spec_plain_step_uses_forward": True,
    # True: a row computed inside an n-row forward is bitwise the row computed alone.
    "spec_batch_invariant": False,
    # True: the trunk holds recurrent state that a rewind cannot undo (needs snapshot/restore).
    "spec_has_recurrent_state": False,
}


def declared(target: object, name: str) -> Any:
    """Read a declaration from any target, falling back to the documented default."""
    return getattr(target, name, TARGET_DECLARATIONS[name])


@runtime_checkable
class SpeculativeTarget(Protocol):
    """What the loop needs from a trunk; nothing about drafting.

    Declarations (`TARGET_DECLARATIONS`) are optional attributes read with `declared()`;
    `spec_on_verify_accepted` and `spec_set_hidden_taps` are optional methods.
    """

    cache_seq_len: int  # positions [0, cache_seq_len) hold committed KV
    max_context_length: int  # tokens
    vocab_size: int  # V, the width of every logits row
    spec_feature_size: int  # F

    def forward(self, tokens: "torch.Tensor") -> "torch.Tensor":
        """The model's own plain prefill/decode: append int64 [n] tokens, return fp32 [V] logits of the last row."""

    def spec_forward(self, tokens: "torch.Tensor", *, hidden: bool, all_logits: bool) -> VerifyOutput:
        """Append n rows at cache_seq_len in one forward.

        tokens: int64 [n], n >= 1. hidden: also return tapped rows [n, F].
        all_logits: logits for every row ([n, V] fp32), else only the last ([1, V]).
        Raises ContextOverflow when cache_seq_len + n > max_context_length.
        """

    def spec_ensure_capacity(self, required_len: int) -> None:
        """Make room for `required_len` positions; raise ContextOverflow if impossible."""

    def spec_rewind_cache(self, length: int) -> None:
        """Set cache_seq_len back to `length` (attention KV only; recurrent state is not undone)."""

    def spec_snapshot_recurrent_state(self) -> None:
        """Copy the recurrent state (conv, SSM, delta-rule) aside; a no-op without one."""

    def spec_restore_recurrent_state(self) -> None:
        """Put the last snapshot back; a no-op without recurrent state."""


@runtime_checkable
class BatchedSpeculativeTarget(Protocol):
    """The same seam over B slots of a paged KV cache with per-slot recurrent state.

    `spec_forward_batch` takes one int64 [n_b] row list per slot and returns one
    VerifyOutput per slot; cache operations take the slot index first.
    """

    max_context_length: int
    spec_feature_size: int

    def spec_slot_seq_len(self, slot: int) -> int: ...

    def spec_forward_batch(self, slots: Sequence[int], tokens: Sequence["torch.Tensor"], *,
                           hidden: bool, all_logits: bool) -> list[VerifyOutput]: ...

    def spec_rewind_slot(self, slot: int, length: int) -> None: ...

    def spec_snapshot_slot(self, slot: int) -> None: ...

    def spec_restore_slot(self, slot: int) -> None: ...


class DraftHeadKind(enum.Enum):
    NONE = "none"  # the model has no drafter: weight-free algorithms only
    PER_TOKEN = "per_token"  # NextN/MTP/assistant: one token per draft step
    BLOCK = "block"  # DFlash-style: a whole block per draft step


@runtime_checkable
class DraftHead(Protocol):
    """Adapter over trained drafter weights bound to one trunk (like a LoRA).

    Reads *this* trunk's hidden rows ([F]) and borrows its embedding and LM head.
    """

    draft_head_kind: DraftHeadKind
    draft_block_size: int  # tokens per draft_block (BLOCK heads); 1 otherwise
    draft_head_resumes_after_gap: bool

    def draft_step(self, token: int, h_prev: "torch.Tensor", pos: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """PER_TOKEN: logits fp32 [V] for position pos+1 and the head's own hidden row [F]."""

    def draft_block(self, last_token: int, h_prev: "torch.Tensor", pos: int) -> tuple[list[int], list[float]]:
        """BLOCK: draft ids for positions pos+1.. and the cumulative prefix probability of each."""

    def draft_catch_up(self, tokens: Sequence[int], h_rows: "torch.Tensor", start_pos: int) -> None:
        """Feed committed tokens and their trunk hidden rows [n, F] that the head has not seen."""


@attrs.frozen
class DraftContext:
    """Everything a speculator may read for one step (one frozen value; new signal = new field)."""

    #: the pending token: emitted, not yet in the trunk's cache; it is verify row 0.
    last_token: int
    #: absolute position last_token will be written at (== trunk cache_seq_len).
    pos: int
    #: most drafts this step may verify (K), already narrowed by the window rule.
    draft_window: int
    #: the gate: algorithm-specific, see Speculator.min_draft_prob.
    min_draft_prob: float
    #: trunk tap [F] of the row at pos-1 (the last committed row), when needs_hidden_state.
    hidden_prev: "torch.Tensor | None" = None
    #: token ids that end generation; a draft never continues past one.
    stop_token_ids: frozenset[int] = frozenset()


class Speculator:
    """Base of every drafting algorithm. A speculator is free to be wrong; it must not be slow.

    The loop calls `commit(tokens, hidden_rows, start_pos)` with every token that lands in
    the trunk's cache (prompt included), in order, and `propose(ctx)` before each verify.
    """

    name: str = "speculator"
    #: K ceiling (the --spec-draft value).
    max_draft_tokens: int = 8
    #: the gate in this algorithm's units (--spec-pmin); defaults to default_min_draft_prob.
    default_min_draft_prob: float = 0.0
    needs_hidden_state: bool = False
    handles_own_prefill: bool = False
    can_arm_after_prefix_reuse: bool = True

    def __init__(self, *, max_draft_tokens: int = 8, min_draft_prob: float | None = None):
        self.max_draft_tokens = max_draft_tokens
        self.min_draft_prob = self.default_min_draft_prob if min_draft_prob is None else min_draft_prob

    def propose(self, ctx: DraftContext) -> list[int]:
        """Draft ids for positions ctx.pos+1 .. (at most ctx.draft_window); may be empty."""
        raise NotImplementedError

    def commit(self, tokens: Sequence[int], hidden_rows: "torch.Tensor | None", start_pos: int) -> None:
        """Tokens that landed in the trunk at positions start_pos.., with their tapped rows [n, F]."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget all history (a new sequence follows)."""

    def close(self) -> None:
        """Release resources; the speculator is not used again."""
