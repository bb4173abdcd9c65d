"""Whether a DFlash drafter can draft for a trunk: `binding_problem(config, tokens, trunk)` -> why not, or None.

A DFlash drafter is bound to one target like a LoRA: it fuses that target's residuals at fixed
layers, borrows its embedding and LM head, and was trained on its tokenizer. The checks are the
reference note's §5.4, each message naming the mismatch and the fix:

1. `fc.weight` input width == T × the trunk's hidden size (T = len(target_layers));
2. the drafter's hidden size == the trunk's (the borrowed embedding and head);
3. every tap L satisfies 0 <= L < the trunk's block count, and the trunk serves it. L == block
   count is refused: the torch reference feeds the post-final-norm state there, llama.cpp the
   pre-norm one (errata 4), and the trunk's tap there is pre-norm;
4. the target head has more rows than the mask id; the drafter's token list equals the trunk's
   (count and sha256 of the pieces), else "drafter built for another tokenizer";
5. DFlash2: the selector codebooks have one row per target-head row.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from verispec.seams import UnsupportedTap, declared

from verispec_dflash.config import DFlashConfig

FIX = "pass a DFlash drafter made for this model as --draft-model (llama.cpp's converter takes the target with --target-model-dir)"


def tokens_digest(pieces: Sequence[str]) -> str:
    """sha256 hex over the token pieces, each UTF-8 encoded and NUL-terminated, in id order."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def binding_problem(config: DFlashConfig, tokens: Sequence[str] | None, trunk) -> str | None:
    """Why the drafter of `config` (file token list `tokens`, or None when it has none) cannot draft
    for `trunk`; None when it can. The first problem found, in the module docstring's order."""
    D = trunk.hidden_size
    T = len(config.target_layers)
    if config.target_hidden_size != D:
        return (f"fc.weight reads {T} taps of {config.target_hidden_size} (width {T * config.target_hidden_size}), "
                f"the trunk's rows are {D} wide ({T} taps = {T * D}); {FIX}")
    if config.hidden_size != D:
        return f"the drafter's hidden size is {config.hidden_size}, the trunk's {D} (it borrows its embedding); {FIX}"
    depth = getattr(trunk, "num_layers", None)
    if depth is not None:
        bad = [L for L in config.target_layers if not 0 <= L < depth]
        if bad:
            last = [L for L in bad if L == depth]
            why = (f" (tap {depth} = after the last layer: the references disagree on pre/post final norm there)"
                   if last else "")
            return (f"the drafter taps target layers {list(config.target_layers)} and the trunk has layers "
                    f"0..{depth - 1}{why}; {FIX}")
    try:
        trunk.view().tap_feature_size(config.target_layers)
    except UnsupportedTap as exc:
        return f"the trunk cannot serve the drafter's taps {list(config.target_layers)}: {exc}; {FIX}"
    V = trunk.vocab_size
    if config.mask_token_id >= V:
        return f"mask id {config.mask_token_id} is past the target head's {V} rows; {FIX}"
    if config.generation == 2 and config.selector_vocab_size != V:
        return (f"the selector codebooks have {config.selector_vocab_size} rows, the target head {V}; "
                f"DFlash2 needs the full target vocabulary; {FIX}")
    return _tokenizer_problem(tokens, trunk)


def _tokenizer_problem(tokens: Sequence[str] | None, trunk) -> str | None:
    tokenizer = declared(trunk, "tokenizer")
    ours = getattr(tokenizer, "tokens", None)
    if ours is None:  # an ids-only trunk: nothing to compare beyond the sizes above
        return None
    if tokens is None:
        return f"the drafter file carries no tokenizer (tokenizer.ggml.tokens) to check against the trunk's; {FIX}"
    if len(tokens) != len(ours) or tokens_digest(tokens) != tokens_digest(ours):
        first = next((i for i, (a, b) in enumerate(zip(tokens, ours)) if a != b), min(len(tokens), len(ours)))
        return (f"drafter built for another tokenizer: {len(tokens)} tokens vs the trunk's {len(ours)}, first "
                f"difference at id {first}; {FIX}")
    return None
