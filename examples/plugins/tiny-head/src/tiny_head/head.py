"""TinyHead: a PER_TOKEN draft head. From the trunk's final-normed row at position p-1 (h, [D])
and the token t at p, it predicts the row at p, `W @ [h; embed(t)]` ([D]), and reads it through
the trunk's own LM head: the logits of position p+1. Bound to one trunk through its read-only
view (embedding, LM head); the file holds W alone.

Shape letters: D the trunk's hidden size, V its vocabulary.
"""
from __future__ import annotations

import torch

from verispec.seams import DraftHeadKind, DrafterMismatch

#: GGUF keys and tensor name of a head file (written by tiny_head.make_head).
HIDDEN_KEY, VOCAB_KEY, WEIGHT = "tiny-head.embedding_length", "tiny-head.vocab_size", "tiny_head.weight"


class TinyHead:
    draft_head_kind = DraftHeadKind.PER_TOKEN
    draft_block_size = 1
    draft_head_resumes_after_gap = True  # it reads only the last row: a gap costs it nothing
    tap_layers = None                    # the final-normed rows (the default tap)

    def __init__(self, view, weight: torch.Tensor):
        self.view = view
        self.weight = weight  # fp32 [D, 2D]

    def new_state(self):
        return None  # nothing per sequence: every draft starts from ctx.hidden_prev

    def draft_step(self, state, token: int, h_prev: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits fp32 [V] for position pos+1 and the predicted row [D] at pos."""
        x = torch.cat([h_prev, self.view.embed(torch.tensor([token]))[0]])  # [2D]
        h = self.weight @ x  # [D]
        return self.view.logits(h[None])[0], h

    def draft_catch_up(self, state, tokens, h_rows, start_pos):
        pass  # no private KV

    def keep(self, state, num_rows):
        pass


def load(path: str, trunk) -> TinyHead:
    """DraftFileSpec loader: the head in `path`, bound to `trunk`; DrafterMismatch names a file
    fitted on another model (its speculator then declines with that line)."""
    import gguf

    reader = gguf.GGUFReader(path)
    hidden, vocab = (int(reader.fields[key].contents()) for key in (HIDDEN_KEY, VOCAB_KEY))
    view = trunk.view()
    if (hidden, vocab) != (view.hidden_size, view.vocab_size):
        raise DrafterMismatch(f"{path}: a tiny-head fitted on a model of width {hidden} and vocabulary {vocab}; "
                              f"this one has {view.hidden_size} and {view.vocab_size}: fit one for it with "
                              "python -m tiny_head.make_head")
    view.tap_feature_size(TinyHead.tap_layers)  # the final-normed tap: every trunk serves it
    tensor, = (t for t in reader.tensors if t.name == WEIGHT)
    weight = torch.from_numpy(tensor.data.copy()).float().reshape(hidden, 2 * hidden)  # [D, 2D]
    return TinyHead(view, weight)
