"""Whether a draft trunk can draft for a trunk: `binding_problem(trunk, draft)` -> why not, or None.

The drafter is fed the trunk's token ids and its argmax ids are verified by the trunk, so the
two must mean the same thing by every id either can see:

- tokenizers: the trunk's pieces are a prefix of the drafter's (equal, or the drafter's list
  padded past the trunk's, as Qwen's checkpoints pad theirs to different lengths), with the same
  BOS, EOS and stop ids. Trunks without tokenizers (ids only) must have the same vocabulary size.
- rollback: the draft trunk must `truncate` a sequence (a rejected draft is cut off); drafters
  with recurrent state (Mamba, delta-rule layers) cannot, and are declined.
"""
from __future__ import annotations

from verispec.seams import Segment, declared


def binding_problem(trunk, draft) -> str | None:
    """Why `draft` (a Trunk) cannot draft for `trunk`, naming the first difference; None when it can."""
    return _tokenizer_problem(trunk, draft) or _rollback_problem(draft)


def _tokenizer_problem(trunk, draft) -> str | None:
    ours, theirs = declared(trunk, "tokenizer"), declared(draft, "tokenizer")
    if ours is None and theirs is None:
        if draft.vocab_size != trunk.vocab_size:
            return (f"the drafter's vocabulary has {draft.vocab_size} ids, the trunk's {trunk.vocab_size} "
                    "(neither has a tokenizer to compare)")
        return None
    if ours is None or theirs is None:
        which = "trunk" if ours is None else "drafter"
        return f"the {which} has no tokenizer, so the two vocabularies cannot be compared"
    pieces, draft_pieces = ours.tokens, theirs.tokens
    for i, (piece, draft_piece) in enumerate(zip(pieces, draft_pieces)):
        if piece != draft_piece:
            return (f"the tokenizers differ at id {i}: the trunk's piece is {piece!r}, the drafter's "
                    f"{draft_piece!r}; pass a drafter of the trunk's tokenizer")
    if len(draft_pieces) < len(pieces):
        return (f"the drafter's tokenizer has {len(draft_pieces)} pieces, the trunk's {len(pieces)}: the "
                f"trunk's ids from {len(draft_pieces)} have no drafter row")
    for name in ("bos_id", "eos_id", "stop_ids"):
        if getattr(ours, name) != getattr(theirs, name):
            return (f"the tokenizers' {name} differ: the trunk's {getattr(ours, name)!r}, the drafter's "
                    f"{getattr(theirs, name)!r}")
    return None


def _rollback_problem(draft) -> str | None:
    from verispec.nn.state import CannotTruncate

    seq = draft.new_sequence()
    try:
        draft.forward([Segment(seq, [0, 0], logits="none")])
        draft.truncate(seq, 1)
    except CannotTruncate as exc:
        return f"the drafter cannot cut a rejected draft off its state ({exc})"
    finally:
        draft.release(seq)
    return None
