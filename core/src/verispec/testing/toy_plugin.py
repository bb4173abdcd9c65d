"""A complete toy plugin: a trunk family, a BLOCK draft head loaded from its own drafter
file (`DraftFileSpec`), and a block speculator that asks the trunk for layer taps.

It exercises the seams no shipped plugin uses yet, and doubles as a worked example for
plugin authors. Register it with an entry point `toy = "verispec.testing.toy_plugin"` or
`Registry.from_plugins({"toy": toy_plugin})`.
"""
from __future__ import annotations

from verispec.hookspecs import hookimpl
from verispec.seams import DraftHeadKind, DrafterMismatch, Speculator
from verispec.specs import DraftFileSpec, SpeculatorSpec, TrunkSpec

#: layers whose entering residuals the toy block head reads (concatenated: F = 2·D).
TAP_LAYERS = (0, 1)

BLOCK_SPEC = SpeculatorSpec(name="toy-block", summary="drafts a block from a BLOCK head (toy)",
                            factory="verispec.testing.toy_plugin:create_block_speculator",
                            requires_draft_head=True, needs_hidden_state=True, can_arm_after_prefix_reuse=False,
                            default_min_draft_prob=0.35, priority=5)


@hookimpl
def register_trunks(register):
    register(TrunkSpec(name="toy", summary="toy trunk for tests (one recurrent + one attention layer)",
                        architectures=("toy",), loader="verispec.testing.toy:load_toy_gguf"))


@hookimpl
def register_draft_files(register):
    register(DraftFileSpec(name="toy-block", summary="toy BLOCK drafter file", architectures=("toy-block-drafter",),
                           loader="verispec.testing.toy_plugin:load_block_drafter"))


@hookimpl
def register_speculators(register):
    register(BLOCK_SPEC)


class ToyBlockHead:
    """BLOCK head: drafts the trunk's bigram-greedy chain (argmax of the LM head over the
    embedding of t), with confidences 0.9^i; reads the tapped rows [F = 2·D] it asked for.
    It binds through the trunk's read-only view: taps validated there, embedding and LM head
    read there, nothing on the trunk changed."""

    draft_head_kind = DraftHeadKind.BLOCK
    draft_head_resumes_after_gap = True
    tap_layers = TAP_LAYERS

    def __init__(self, view, block_size: int = 4):
        import torch

        self.feature_size = view.tap_feature_size(self.tap_layers)
        self.draft_block_size = block_size
        self.next_of = torch.argmax(view.logits(view.embed(torch.arange(view.vocab_size))), dim=1).tolist()  # [V]
        self.h_shapes: set[tuple[int, ...]] = set()

    def new_state(self) -> dict:
        return {"num_caught_up": 0}

    def draft_block(self, state, last_token, h_prev, pos, num_rows=None):
        if h_prev is not None:
            self.h_shapes.add(tuple(h_prev.shape))
        ids, token = [], last_token
        for _ in range(self.draft_block_size if num_rows is None else num_rows - 1):
            token = self.next_of[token]
            ids.append(token)
        return ids, [0.9 ** (i + 1) for i in range(len(ids))]

    def draft_step(self, state, token, h_prev, pos):
        raise NotImplementedError("a BLOCK head drafts whole blocks")

    def draft_catch_up(self, state, tokens, h_rows, start_pos):
        state["num_caught_up"] += len(tokens)

    def keep(self, state, num_rows):
        pass  # no private KV


def load_block_drafter(path, trunk) -> ToyBlockHead:
    """DraftFileSpec loader: refuses a drafter made for another vocabulary."""
    from verispec.gguf.io import GGUFFile

    vocab = GGUFFile.open(path).require("toy-block-drafter.vocab_size")
    if vocab != trunk.vocab_size:
        raise DrafterMismatch(f"{path}: drafter vocabulary {vocab} != trunk vocabulary {trunk.vocab_size}; "
                              "use the drafter trained for this model")
    return ToyBlockHead(trunk.view())


def write_block_drafter(path, vocab_size: int) -> str:
    from verispec.testing.fixture_writer import write_gguf

    return write_gguf(path, arch="toy-block-drafter", metadata={"toy-block-drafter.vocab_size": vocab_size},
                      tensors={}, vocab=None)


class BlockSpeculator(Speculator):
    """Proposes a BLOCK head's draft, cut where the cumulative confidence drops below the gate."""

    def __init__(self, head, spec=BLOCK_SPEC, **kwargs):
        super().__init__(spec, **kwargs)
        self.head = head
        self.tap_layers = head.tap_layers

    def new_state(self):
        return self.head.new_state()

    def propose(self, state, ctx):
        if ctx.last_token in ctx.stop_token_ids:  # never draft past a stop
            return []
        ids, confidences = self.head.draft_block(state, ctx.last_token, ctx.hidden_prev, ctx.pos)
        keep = []
        for token, confidence in zip(ids[:ctx.max_draft_tokens], confidences):
            if confidence < ctx.min_draft_prob:
                break
            keep.append(token)
            if token in ctx.stop_token_ids:  # a draft ends at the first stop id
                break
        return keep

    def commit(self, state, tokens, hidden_rows, start_pos):
        self.head.draft_catch_up(state, tokens, hidden_rows, start_pos)

    def keep(self, state, num_rows):
        self.head.keep(state, num_rows)


def create_block_speculator(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
    if draft_head.draft_head_kind is not DraftHeadKind.BLOCK:
        return None
    return BlockSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
