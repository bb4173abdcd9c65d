"""Whether an EAGLE-3 head can draft for a trunk: `binding_problem(config, d2t, tokens, trunk)` -> why not, or None.

A head is bound to one target like a LoRA: fc reads that target's residuals at fixed layers, the
head borrows its embedding (and its LM head when it has no `output`), and its draft vocabulary
names target ids. The checks, in order, each message naming the mismatch and the fix:

1. the trunk is a llama/qwen2 trunk (the families whose taps and raw embedding rows this head
   was checked against; others are refused until checked);
2. target_hidden_size == the trunk's hidden size (fc reads 3 rows of it);
3. every target layer id L satisfies 0 <= L < the trunk's block count (llama.cpp extracts at a
   layer's INPUT, il in 0..n_layer-1) and the trunk serves the taps;
4. the head's width == the trunk's where it borrows the embedding or the LM head;
5. vocabulary: an own token_embd has the trunk's V rows; d2t ids lie in [0, V) and are distinct
   (and, without d2t, the draft vocabulary is the trunk's); the file's token list, when it and
   the trunk have one, is the trunk's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from verispec.seams import UnsupportedTap, declared

from verispec_eagle3.config import Eagle3Config

FIX = "pass an EAGLE-3 head made for this model as --draft-model (llama.cpp's converter takes the target with " \
      "--target-model-dir)"
#: trunk `config.architecture` values whose taps (Segment.tap_layers) and embedding rows this head reads.
TRUNK_ARCHITECTURES = ("llama", "qwen2")


def binding_problem(config: Eagle3Config, d2t: torch.Tensor | None, tokens: Sequence[str] | None,
                    trunk) -> str | None:
    """Why the head of `config` (its d2t int64 [Vd] or None, its file's token list or None)
    cannot draft for `trunk`; None when it can. The first problem, in the module docstring's order."""
    arch = getattr(getattr(trunk, "config", None), "architecture", None)
    if arch not in TRUNK_ARCHITECTURES:
        return (f"EAGLE-3 heads draft for {'/'.join(TRUNK_ARCHITECTURES)} trunks here, and this model is "
                f"{arch or type(trunk).__name__}; serve a llama or qwen2 model")
    D, V = trunk.hidden_size, trunk.vocab_size
    if config.target_hidden_size != D:
        return (f"the head's fc reads 3 trunk rows of {config.target_hidden_size} (eagle3.target_hidden_size), "
                f"the trunk's rows are {D} wide; {FIX}")
    depth = trunk.num_layers
    bad = [L for L in config.target_layers if not 0 <= L < depth]
    if bad:
        return (f"the head taps trunk layers {list(config.target_layers)} (residuals entering them) and the trunk "
                f"has layers 0..{depth - 1}: {bad} past its depth; {FIX}")
    try:
        trunk.view().tap_feature_size(config.target_layers)
    except UnsupportedTap as exc:
        return f"the trunk cannot serve the head's taps {list(config.target_layers)}: {exc}; {FIX}"
    borrowed = [what for what, own in (("embedding", config.own_embedding), ("LM head", config.own_output))
                if not own]
    if borrowed and config.hidden_size != D:
        return (f"the head is {config.hidden_size} wide and borrows the trunk's {' and '.join(borrowed)} "
                f"({D} wide); {FIX}")
    if config.own_embedding and config.embedding_rows != V:
        return f"the head's token_embd has {config.embedding_rows} rows, the trunk's vocabulary {V}; {FIX}"
    if d2t is None:
        if config.draft_vocab_size not in (None, V):
            return (f"the head scores {config.draft_vocab_size} draft rows without a d2t map to the trunk's {V} "
                    f"ids; {FIX}")
    else:
        if not config.own_output and d2t.numel() != V:
            return (f"d2t maps {d2t.numel()} draft rows, and the head borrows the trunk's LM head of {V} rows; "
                    f"{FIX}")
        outside = d2t[(d2t < 0) | (d2t >= V)]
        if outside.numel():
            return (f"d2t names target ids outside the trunk's vocabulary 0..{V - 1} (e.g. {int(outside[0])}): "
                    f"the head was made for another vocabulary; {FIX}")
        if torch.unique(d2t).numel() != d2t.numel():
            return ("d2t names a target id twice (llama.cpp's converter writes absolute ids, HF's checkpoints "
                    f"offsets d2t[i] - i: a file of offsets was not converted); {FIX}")
    return _tokenizer_problem(tokens, trunk)


def _tokenizer_problem(tokens: Sequence[str] | None, trunk) -> str | None:
    ours = getattr(declared(trunk, "tokenizer"), "tokens", None)
    if ours is None or tokens is None:  # an ids-only trunk, or a head file without a token list
        return None
    if list(tokens) != list(ours):
        first = next((i for i, (a, b) in enumerate(zip(tokens, ours)) if a != b), min(len(tokens), len(ours)))
        return (f"the head was made for another tokenizer: {len(tokens)} tokens vs the trunk's {len(ours)}, first "
                f"difference at id {first}; {FIX}")
    return None
