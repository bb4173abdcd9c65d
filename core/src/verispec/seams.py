"""The seams between the loop and what plugs into it (docs/design.md §3).

Shape letters: n rows of one sequence in a forward, V vocabulary, D hidden size, F feature
width of a hidden tap (`TrunkView.tap_feature_size`), K draft length.

- `Trunk`: the trunk (the model being served): `forward` over `Segment`s of
  several sequences, `keep` after a verify, sequences that come and go.
- `TrunkView`: the read-only face of a trunk that a draft head binds to.
- `DraftHead` (+ `DraftHeadKind`): a thin adapter over drafter weights bound to one trunk;
  `DraftModel`: a whole second trunk that drafts.
- `Speculator`: a drafting algorithm with per-sequence state; `DraftContext` is everything
  it may read per step.

No loop lives here: `execution.SpeculativeExecution` is the one implementation.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from verispec.errors import VerispecError, larger_context_advice

if TYPE_CHECKING:  # torch is imported lazily: `verispec plugins` must not load it
    import torch


class ContextOverflow(VerispecError, ValueError):
    """A forward would write past the trunk's `max_context_length`. trained_context_length: the
    positions the model was trained on, when the trunk knows it: a larger --context-length is
    suggested only while the context is below it. prompt: the prompt alone does not fit (so
    fewer new tokens would not help)."""

    def __init__(self, required_len: int, max_context_length: int, trained_context_length: int | None = None,
                 *, prompt: bool = False):
        self.required_len = required_len
        self.max_context_length = max_context_length
        fewer = "" if prompt else " or lower --max-tokens"
        super().__init__(f"need {required_len} positions but the context holds {max_context_length}; "
                         f"shorten the prompt{fewer}{larger_context_advice(max_context_length, trained_context_length)}")


class DrafterMismatch(VerispecError, ValueError):
    """A drafter bound to another trunk (vocabulary, tokenizer, sizes, taps): a speculator
    factory raises it to decline with the message as its reason (not a broken plugin)."""


class UnsupportedTap(ValueError):
    """The trunk cannot serve the hidden-state tap a drafter asked for."""


#: the most drafts one step may verify (K); a verify forwards at most MAX_DRAFT_TOKENS + 1 rows.
MAX_DRAFT_TOKENS = 64


@attrs.frozen
class Segment:
    """The rows one sequence appends in a forward: the tokens at positions seq_len(seq)...

    Several segments (each a different sequence) form one batch: a chunked prefill, a
    one-row decode and a k-row verify are the same thing with different flags.
    """

    #: a sequence id from `new_sequence()`.
    seq: int
    #: int64 [n], n >= 1 (a tensor or a list of ids).
    tokens: Any = attrs.field(converter=lambda t: _as_ids(t))
    #: "all": fp32 logits [n, V]; "last": [1, V] of the last row; "none": no logits.
    logits: str = attrs.field(default="last", validator=attrs.validators.in_(("all", "last", "none")))
    #: also return hidden tap rows [n, F].
    hidden: bool = False
    #: which taps: None = final-normed rows (F = hidden size); else the residuals entering these
    #: layers, concatenated (F = hidden size · len); index num_layers = after the last layer.
    tap_layers: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    #: a verify: the trunk keeps what `keep(seq, num_rows)` needs (per-row recurrent state).
    verify: bool = False


def _as_ids(tokens) -> "torch.Tensor":
    import torch

    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("a segment needs at least one token")
    return ids


@attrs.frozen
class SegmentOutput:
    #: fp32 [n, V] ("all"), [1, V] ("last"), or None ("none").
    logits: "torch.Tensor | None"
    #: tapped rows fp32 [n, F], or None when not asked for.
    hidden: "torch.Tensor | None" = None


# Declarations a trunk may override; read them through `declared()`, nowhere else.
TRUNK_DECLARATIONS: dict[str, Any] = {
    # Correctness verdict: non-None makes every layer decline speculation and decode plainly.
    "speculation_refusal": None,
    # Speed verdict: False makes `auto` decline (an explicit --spec-type still runs).
    "speculation_profitable": True,
    # Narrows the *default* draft window only, never an explicit --spec-draft.
    "spec_preferred_max_draft_tokens": None,
    # True: a row computed inside an n-row forward (any mix of sequences) is bitwise the row computed alone.
    "spec_batch_invariant": False,
    # Memory: (num_positions) -> bytes one sequence may occupy; None = the scheduler's KV budget skips this trunk.
    "sequence_nbytes": None,
    # Memory: (seq) -> bytes a sequence holds now; None = its `sequence_nbytes` at its length stands in.
    "sequence_held_nbytes": None,
    # Context: the positions the model was trained on; None = unknown (a larger --context-length is suggested unbounded).
    "trained_context_length": None,
    # Drafting: the DraftHead the model file carries (e.g. MTP weights); None = none, or --draft-model loads one.
    "draft_head": None,
    # Text: the verispec.tokenizer.Tokenizer turning text into ids and back; None = the trunk takes ids only.
    "tokenizer": None,
    # Damage: () -> None raising errors.DamagedFile when the model file holds non-finite weights; called only
    # after a forward gave unusable logits (it may read the whole file); None = such logits stay a bug.
    "check_weights": None,
}


def declared(trunk: object, name: str) -> Any:
    """Read a declaration from any trunk, falling back to the documented default."""
    return getattr(trunk, name, TRUNK_DECLARATIONS[name])


@runtime_checkable
class Trunk(Protocol):
    """The trunk seam: one batch-shaped forward over flat rows of several sequences; the
    trunk owns every sequence's state and undoes a rejected tail itself (`keep`).

    Declarations (`TRUNK_DECLARATIONS`) are optional attributes read with `declared()`.
    """

    max_context_length: int  # tokens per sequence
    vocab_size: int  # V, the width of every logits row
    hidden_size: int  # D, the width of a final-normed tap row

    def new_sequence(self) -> int:
        """A new, empty sequence; returns its id."""

    def release(self, seq: int) -> None:
        """Free a sequence's state; its id is not used again."""

    def seq_len(self, seq: int) -> int:
        """Committed positions of `seq` (the next row goes there)."""

    def forward(self, batch: Sequence[Segment]) -> list[SegmentOutput]:
        """Append each segment's rows to its sequence in one forward; one output per segment.

        Raises ContextOverflow (nothing written) when a sequence would pass
        max_context_length, UnsupportedTap for tap layers the trunk does not have,
        ValueError for an unknown sequence or one named twice.
        """

    def keep(self, seq: int, num_rows: int) -> None:
        """After a verify of n rows on `seq`: commit its first `num_rows` (0..n), discard the rest
        (KV, per-row recurrent state, ...). Full acceptance costs nothing. Raises ValueError when
        the sequence's last forward was not a verify."""

    def truncate(self, seq: int, length: int) -> None:
        """Cut `seq` back to its first `length` positions (chat-turn prefix reuse); 0 always
        works. Raises nn.kv_cache.CannotTruncate with the reason when the state kinds cannot."""

    def fork(self, seq: int, length: int) -> int:
        """A new sequence holding a copy of the first `length` positions of `seq` (prefix caching;
        `seq` is unchanged); returns its id. Raises nn.kv_cache.CannotTruncate with the reason where
        `truncate(seq, length)` would (recurrent state forks only at seq_len(seq))."""

    def view(self) -> "TrunkView":
        """The read-only face a draft head binds to."""


@runtime_checkable
class TrunkView(Protocol):
    """What a draft head may read of the trunk; it never mutates it."""

    vocab_size: int
    hidden_size: int

    def tap_feature_size(self, tap_layers: Sequence[int] | None) -> int:
        """F for those taps (see Segment.tap_layers); raises UnsupportedTap when the trunk cannot serve them."""

    def embed(self, tokens: "torch.Tensor") -> "torch.Tensor":
        """The input embedding rows fp32 [n, D] of int64 [n] tokens (as the trunk's first layer sees them)."""

    def logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """The LM head over final-normed rows fp32 [n, D] -> fp32 [n, V] (final softcap included)."""

    def kv(self, seq: int, layer: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        """Committed K/V of one attention layer for heads that read the trunk's cache: k, v fp32
        [Hkv, T, Dh] and each slot's position int64 [T] (-1 = empty). ValueError for a layer without KV."""


class DraftHeadKind(enum.Enum):
    NONE = "none"  # the model has no drafter: weight-free algorithms only
    PER_TOKEN = "per_token"  # NextN/MTP/assistant: one token per draft step
    BLOCK = "block"  # DFlash-style: a whole block per draft step
    MODEL = "model"  # a whole second trunk (a small model of the same tokenizer): `DraftModel`


@runtime_checkable
class DraftHead(Protocol):
    """Adapter over trained drafter weights bound to one trunk (like a LoRA).

    Reads *this* trunk's hidden rows ([F]) and borrows its embedding and LM head through the
    trunk's read-only `TrunkView`. Like a speculator, one head serves every sequence: what it
    holds of one sequence (its private KV, rows it has seen) is the state `new_state()` returns,
    and every call names that state.
    """

    draft_head_kind: DraftHeadKind
    draft_block_size: int  # tokens per draft_block (BLOCK heads); 1 otherwise
    draft_head_resumes_after_gap: bool
    #: the trunk layers whose entering residuals the head reads (Segment.tap_layers); None = final-normed rows.
    tap_layers: tuple[int, ...] | None

    def new_state(self) -> Any:
        """The head's state for a new sequence."""

    def draft_step(self, state: Any, token: int, h_prev: "torch.Tensor", pos: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """PER_TOKEN: logits fp32 [V] for position pos+1 and the head's own hidden row [F]."""

    def draft_block(self, state: Any, last_token: int, h_prev: "torch.Tensor", pos: int,
                    num_rows: int | None = None) -> tuple[list[int], list[float]]:
        """BLOCK: draft ids for positions pos+1.. and the cumulative prefix probability of each.
        num_rows: block rows to run, 2..draft_block_size (anchor + num_rows - 1 drafts: a window
        narrower than the trained block costs less); None = draft_block_size."""

    def draft_catch_up(self, state: Any, tokens: Sequence[int], h_rows: "torch.Tensor", start_pos: int) -> None:
        """Feed committed tokens and their trunk hidden rows [n, F] that the head has not seen."""

    def keep(self, state: Any, num_rows: int) -> None:
        """The trunk kept `num_rows` rows of the last verify: drop the head's KV past them."""


@attrs.frozen
class DraftModel:
    """A second trunk that drafts for the served one (--draft-model naming a trunk family's file):
    what a speculator factory receives as `draft_head` then. It reads nothing of the served trunk;
    the speculator binds the two (tokenizers) and owns the draft trunk's sequences."""

    #: the draft trunk (a `Trunk`), loaded by the registry like any model.
    trunk: Any
    #: the file it was loaded from (for messages).
    path: str = ""
    draft_head_kind: DraftHeadKind = DraftHeadKind.MODEL
    tap_layers: tuple[int, ...] | None = None


@attrs.frozen
class DraftContext:
    """Everything a speculator may read for one step (one frozen value; new signal = new field)."""

    #: the pending token: emitted, not yet in the trunk's cache; it is verify row 0.
    last_token: int
    #: absolute position last_token will be written at (== trunk.seq_len(seq)).
    pos: int
    #: most drafts this step may verify (K), already narrowed by the window rule.
    max_draft_tokens: int
    #: the gate: algorithm-specific, see Speculator.min_draft_prob.
    min_draft_prob: float
    #: trunk tap [F] of the row at pos-1 (the last committed row), when needs_hidden_state.
    hidden_prev: "torch.Tensor | None" = None
    #: token ids that end generation; a draft never continues past one.
    stop_token_ids: frozenset[int] = frozenset()
    #: the sequence being drafted for, and the trunk's read-only view (heads that read its KV).
    seq: int | None = None
    trunk: "TrunkView | None" = None


class Proposal(list):
    """A scored draft: the draft ids (a list[int], as `propose` returns) and `probs`, the
    drafter's probability of each draft given the drafts before it (floats in [0, 1], one per
    id). A speculator whose spec declares `scores_drafts` returns one from `propose`: the engine
    calibrates the probabilities against what it accepts (verispec.cost_model.Calibration) and
    verifies the prefix that pays. Raises ValueError when probs is not one number in [0, 1] per id."""

    def __init__(self, tokens, probs):
        super().__init__(tokens)
        self.probs = [float(p) for p in probs]
        if len(self.probs) != len(self) or not all(0.0 <= p <= 1.0 for p in self.probs):
            raise ValueError(f"Proposal of {len(self)} ids with probs {self.probs!r}: give one probability "
                             "in [0, 1] per id")


class Speculator:
    """Base of every drafting algorithm. A speculator is free to be wrong; it must not be slow.

    One speculator serves every sequence of an engine; what it knows of one sequence lives in
    the state `new_state()` returns (history, n-gram index, a head's private KV). The loop
    calls `commit(state, tokens, hidden_rows, start_pos)` with every token that lands in that
    sequence (prompt included), in order, and `propose(state, ctx)` before each verify.

    Its declarations (needs_hidden_state, can_arm_after_prefix_reuse, requires_draft_head,
    default_min_draft_prob) live in one place: `self.spec`, the SpeculatorSpec it registered.
    """

    #: the layers whose entering residuals this speculator reads (Segment.tap_layers); None =
    #: final-normed rows. Set when a head binds (validated by TrunkView.tap_feature_size).
    tap_layers: tuple[int, ...] | None = None

    def __init__(self, spec, *, max_draft_tokens: int = 8, min_draft_prob: float | None = None):
        self.spec = spec  # verispec.specs.SpeculatorSpec
        #: K ceiling (the --spec-draft value).
        self.max_draft_tokens = max_draft_tokens
        #: the gate in this algorithm's units (--spec-pmin).
        self.min_draft_prob = spec.default_min_draft_prob if min_draft_prob is None else min_draft_prob

    @property
    def name(self) -> str:
        return self.spec.name

    def new_state(self) -> Any:
        """Drafting state for a new sequence (nothing committed yet)."""
        return None

    def prepare(self, state: Any, ctx: DraftContext) -> None:
        """Before `propose`, in a step that drafts: catch-up work owed for committed tokens the
        drafter has not seen (a draft model's prompt, or rows decoded while parked). One-off work,
        like a prefill: the governor times neither it nor counts it as drafting (rule 12 judges
        `propose` alone). `propose` must not depend on it having run. Default: nothing."""

    def propose(self, state: Any, ctx: DraftContext) -> list[int]:
        """Draft ids for positions ctx.pos+1 .. (at most ctx.max_draft_tokens); may be empty. With
        spec.scores_drafts, a `Proposal` (the ids and each one's probability)."""
        raise NotImplementedError

    def propose_batch(self, states: Sequence[Any], ctxs: Sequence[DraftContext]) -> list[list[int]]:
        """`propose` for several sequences of one engine step at once (one state and context each,
        in order); returns one draft per context. Default: `propose` for each. A drafter that runs
        a model overrides it to forward all of them together, one forward per draft position."""
        return [self.propose(state, ctx) for state, ctx in zip(states, ctxs)]

    def commit(self, state: Any, tokens: Sequence[int], hidden_rows: "torch.Tensor | None", start_pos: int) -> None:
        """Tokens that landed in the sequence at positions start_pos.., with their tapped rows [n, F]."""
        raise NotImplementedError

    def keep(self, state: Any, num_rows: int) -> None:
        """The trunk kept `num_rows` rows of the last verify: drop what the drafter's own KV holds past them."""

    def close(self) -> None:
        """Release resources; the speculator is not used again."""


class HeadSpeculator(Speculator):
    """A Speculator drafting with a `DraftHead` (an MTP block, an EAGLE-3 head, a Gemma 4
    assistant, a DFlash drafter): it reads the head's taps (`tap_layers`) and keeps the head's
    per-sequence state in step with the trunk (`new_state`, `commit` -> `DraftHead.draft_catch_up`,
    `keep` -> `DraftHead.keep`). A subclass writes `propose`. Raises ValueError for a head whose
    `draft_head_kind` is not `head_kind` (when the subclass sets one)."""

    #: the DraftHeadKind this speculator drafts with; None: the factory checked the head already.
    head_kind: DraftHeadKind | None = None

    def __init__(self, head: DraftHead, spec, **kwargs):
        if self.head_kind is not None and head.draft_head_kind is not self.head_kind:
            raise ValueError(f"{type(self).__name__} drafts with {self.head_kind.value} heads, "
                             f"got a {head.draft_head_kind.value} head")
        super().__init__(spec, **kwargs)
        self.head = head
        self.tap_layers = head.tap_layers

    def new_state(self) -> Any:
        return self.head.new_state()

    def commit(self, state: Any, tokens: Sequence[int], hidden_rows: "torch.Tensor | None", start_pos: int) -> None:
        self.head.draft_catch_up(state, tokens, hidden_rows, start_pos)

    def keep(self, state: Any, num_rows: int) -> None:
        self.head.keep(state, num_rows)
