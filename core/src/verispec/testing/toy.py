"""Tiny trunks and scripted drafters for conformance tests (fp32, CPU, deterministic).

`ToyTrunk` is a two-layer model on the real seam (`nn.trunk.SequenceTrunk`): a recurrent
layer — a depthwise short convolution then a delta-rule matrix state, the shape of
GatedDeltaNet / Mamba-2 state at toy size — and one attention layer over a `PagedKVCache`.
Its recurrent state (`nn.state.RecurrentState`: conv tail [2, D], matrix [D, D]) is recorded
after every verify row, so `keep` selects it with no re-forward, exactly as a real hybrid
family will. Every row is computed with the same one-row ops whatever the batch, so it is
batch-invariant by construction. Its short convolution is the toy plugin's own C kernel
(`toy_conv.c`, built through `kernels.build.CLibrary` as any distribution's would be), bitwise
its PyTorch statement `reference_short_conv`, which runs where the kernel cannot be built.

Shape letters: n rows, V vocabulary, D width.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.kernels.build import CLibrary
from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.state import RecurrentState
from verispec.nn.trunk import Rows, SequenceTrunk
from verispec.seams import Speculator
from verispec.specs import SpeculatorSpec

#: rows of the short convolution (the current row and CONV_WIDTH - 1 before it).
CONV_WIDTH = 3


def _declare(lib: ctypes.CDLL) -> None:
    lib.verispec_toy_short_conv.restype = None
    lib.verispec_toy_short_conv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3


LIBRARY = CLibrary("toy", [Path(__file__).with_name("toy_conv.c")], declare=_declare,
                   fallback="the toy trunk's short convolution runs on its PyTorch path")


def short_conv(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal short convolution: padded fp32 [n + W - 1, D] (the state's W - 1 tail
    rows, then the n rows), weight fp32 [W, D] -> fp32 [n, D] (arithmetic: `reference_short_conv`).
    The C kernel where it is built, else the reference."""
    lib = LIBRARY.load()
    if lib is None:
        return reference_short_conv(padded, weight)
    padded, weight = padded.float().contiguous(), weight.float().contiguous()
    width, dim = weight.shape
    out = torch.empty(padded.shape[0] - width + 1, dim)
    lib.verispec_toy_short_conv(padded.data_ptr(), weight.data_ptr(), out.data_ptr(), out.shape[0], width, dim)
    return out


def reference_short_conv(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`verispec_toy_short_conv` of toy_conv.c, operation by operation: out[i] = Σ_w
    padded[i + w] · weight[w], summed over w = 0, 1, ... in order."""
    width = weight.shape[0]
    n = padded.shape[0] - width + 1
    out = padded[0:n] * weight[0]
    for w in range(1, width):
        out = out + padded[w:w + n] * weight[w]
    return out


class ToyTrunk(SequenceTrunk):
    """Layer 0: recurrent (delta rule over a short conv), or identity when recurrent=False;
    layer 1: one-head causal attention. Taps: residuals entering layer 0 (the embedding) and
    layer 1; the final row is the output of layer 1 (no final norm)."""

    spec_batch_invariant = True
    num_layers = 2

    def __init__(self, vocab_size: int = 32, dim: int = 16, *, recurrent: bool = True,
                 max_context_length: int = 512, seed: int = 0, max_rows_per_forward: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale  # noqa: E731
        self.vocab_size, self.hidden_size, self.recurrent = vocab_size, dim, recurrent
        self.max_context_length, self.max_rows_per_forward = max_context_length, max_rows_per_forward
        self.embedding = rand(vocab_size, dim)  # [V, D]
        self.conv = rand(CONV_WIDTH, dim, scale=0.5)  # [W, D] depthwise
        self.delta_q, self.delta_k = (rand(dim, dim, scale=dim ** -0.5) for _ in range(2))
        self.delta_v = rand(dim, dim, scale=2 * dim ** -0.5)  # a strong recurrent signal: streams differ from attention-only
        self.delta_beta = rand(dim, scale=dim ** -0.5)  # [D]
        self.wq, self.wk, self.wv = (rand(dim, dim, scale=dim ** -0.5) for _ in range(3))
        self.head = rand(vocab_size, dim, scale=2.0)  # [V, D]: sharp logits, few near-ties
        self.num_forwards = 0

    def _new_layer_states(self) -> list:
        d = self.hidden_size
        recurrent = RecurrentState({"conv": (CONV_WIDTH - 1, d), "matrix": (d, d)}) if self.recurrent else None
        return [recurrent, PagedKVCache(1, d, max_positions=self.max_context_length)]

    def forward(self, batch):
        self.num_forwards += 1
        return super().forward(batch)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens]

    def _lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.head @ row for row in normed])  # one matvec per row: batch-invariant

    def _forward_rows(self, rows: Rows):
        x = self._embed(rows.tokens)  # [n, D]
        h = torch.empty_like(x)
        out = torch.empty_like(x)
        for s in rows.sequences:
            recurrent, cache = s.state.layers
            h[s.rows] = x[s.rows] if recurrent is None else x[s.rows] + self._delta_rule(x[s.rows], recurrent)
            for i in range(s.begin, s.end):  # attention, one row at a time
                out[i] = self._attend(h[i], cache, int(rows.positions[i]))
        return out, {0: x, 1: h, 2: out}

    def _delta_rule(self, x: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """x [n, D] -> output rows [n, D]; records the state after every row (state.update)."""
        conv, matrix = state.values["conv"], state.values["matrix"]
        padded = torch.cat([conv, x])  # [W - 1 + n, D]
        pre = short_conv(padded, self.conv)  # [n, D]
        outputs, convs, matrices = [], [], []
        for i in range(x.shape[0]):
            u = F.silu(pre[i])  # [D]
            k = F.normalize(self.delta_k @ u, dim=0)
            q = F.normalize(self.delta_q @ u, dim=0)
            beta = torch.sigmoid(self.delta_beta @ u)
            matrix = matrix + beta * torch.outer(self.delta_v @ u - matrix @ k, k)  # S += β (v - S k) kᵀ
            conv = padded[i + 1:i + CONV_WIDTH]  # the state's tail after row i
            outputs.append(matrix @ q)
            convs.append(conv)
            matrices.append(matrix)
        state.update({"conv": torch.stack(convs), "matrix": torch.stack(matrices)})
        return torch.stack(outputs)

    def _attend(self, h: torch.Tensor, cache: PagedKVCache, pos: int) -> torch.Tensor:
        cache.write(pos, (self.wk @ h)[None, None], (self.wv @ h)[None, None])
        k, v, _ = cache.read(pos + 1)  # [1, pos+1, D]
        scores = k[0] @ (self.wq @ h) / self.hidden_size ** 0.5  # [pos+1]
        return h + torch.softmax(scores, dim=0) @ v[0]


class MarkovTrunk(SequenceTrunk):
    """Logits depend only on the row's token: logits = table[token] (fp32 [V, V]).

    Cheap enough for 100k-draw distribution tests; batch-invariant (pure indexing). Its
    "hidden row" is the token id itself ([n, 1]).
    """

    spec_batch_invariant = True
    hidden_size = 1
    num_layers = 0

    def __init__(self, table: torch.Tensor, max_context_length: int = 1 << 20):
        super().__init__()
        self.table = table.float()
        self.vocab_size = table.shape[0]
        self.max_context_length = max_context_length
        self.max_rows_per_forward = 1 << 16

    def _new_layer_states(self) -> list:
        return []

    def _embed(self, tokens):
        return tokens.float()[:, None]

    def _forward_rows(self, rows):
        return self._embed(rows.tokens), {}

    def _lm_head(self, normed):
        return self.table[normed[:, 0].long()]


class ScriptedState:
    """What a ScriptedSpeculator saw of one sequence."""

    def __init__(self):
        self.committed: list[int] = []
        self.hidden_rows: list = []


class ScriptedSpeculator(Speculator):
    """Proposes from a script: `script(ctx) -> list[int]`. Tracks what each sequence committed;
    `last_state` is the state of the sequence it served last."""

    def __init__(self, script, *, max_draft_tokens: int = 8, needs_hidden_state: bool = False,
                 tap_layers: Sequence[int] | None = None, spec: SpeculatorSpec | None = None):
        spec = spec or SpeculatorSpec(name="scripted", summary="scripted drafts (tests)", factory=ScriptedSpeculator,
                                      needs_hidden_state=needs_hidden_state)
        super().__init__(spec, max_draft_tokens=max_draft_tokens)
        self.script = script
        self.tap_layers = None if tap_layers is None else tuple(tap_layers)
        self.last_state: ScriptedState | None = None

    def new_state(self):
        self.last_state = ScriptedState()
        return self.last_state

    def propose(self, state, ctx):
        self.last_state = state
        return list(self.script(ctx))[:ctx.max_draft_tokens]

    def commit(self, state, tokens, hidden_rows, start_pos):
        if start_pos != len(state.committed):
            raise AssertionError(f"commit at {start_pos} but {len(state.committed)} tokens committed")
        state.committed.extend(tokens)
        if hidden_rows is not None:
            state.hidden_rows.extend(hidden_rows)


class EchoSpeculator(Speculator):
    """Proposes what followed the previous occurrence of the pending token (a 1-gram lookup);
    its state per sequence is the history. `num_states` counts the states made (all instances)."""

    num_states = 0

    def new_state(self):
        EchoSpeculator.num_states += 1
        return []

    def propose(self, history, ctx):
        seq = history + [ctx.last_token]
        for i in range(len(seq) - 2, -1, -1):
            if seq[i] == ctx.last_token:
                return seq[i + 1:i + 1 + ctx.max_draft_tokens]
        return []

    def commit(self, history, tokens, hidden_rows, start_pos):
        del history[start_pos:]
        history.extend(tokens)


def oracle_speculator(reference: Sequence[int], *, correct: int | None = None, vocab_size: int,
                      max_draft_tokens: int = 8, rng=None) -> ScriptedSpeculator:
    """Drafts from the plain stream `reference` (prompt + output, by position).

    correct=None: every draft right (a perfect drafter). correct=0: every draft wrong.
    rng: a random.Random choosing how many drafts are right each step (random accept counts).
    """
    def script(ctx):
        want = list(reference[ctx.pos + 1:ctx.pos + 1 + ctx.max_draft_tokens])
        if not want:
            return [0]
        n_right = len(want) if correct is None and rng is None else (
            rng.randint(0, len(want)) if rng is not None else min(correct, len(want)))
        return want[:n_right] + [(t + 1) % vocab_size for t in want[n_right:]]
    return ScriptedSpeculator(script, max_draft_tokens=max_draft_tokens)


#: a minimal chat template for toy GGUFs (`write_toy_gguf(..., chat_template=CHAT_TEMPLATE)`):
#: `<role>content` lines; an assistant turn renders as the generation prompt, the answer and
#: EOS, so a conversation's next turn starts with the tokens the previous one left in the cache.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_toy_gguf(path, *, vocab_size: int = 300, dim: int = 16, recurrent: bool = True, seed: int = 0,
                   context_length: int = 512, chat_template: str | None = None) -> str:
    """A GGUF (architecture "toy", no tensors: weights come from `seed`) with a byte-level
    vocabulary, so the real load path (registry → loader → tokenizer → engine) runs on it.
    chat_template: stored as `tokenizer.chat_template` (jinja2), for chat requests."""
    from verispec.testing.fixture_writer import byte_level_vocab, write_gguf

    metadata = {"toy.vocab_size": vocab_size, "toy.embedding_length": dim, "toy.recurrent": recurrent,
                "toy.seed": seed, "toy.context_length": context_length}
    return write_gguf(path, arch="toy", metadata=metadata, tensors={},
                      vocab=byte_level_vocab(vocab_size, chat_template=chat_template))


def load_toy_gguf(path, *, dtype=None, context_length=None) -> ToyTrunk:
    """TrunkSpec loader for `write_toy_gguf` files."""
    from verispec.gguf.io import GGUFFile
    from verispec.tokenizer import Tokenizer

    gguf = GGUFFile.open(path)
    trunk = ToyTrunk(gguf.require("toy.vocab_size"), gguf.require("toy.embedding_length"),
                       recurrent=bool(gguf.require("toy.recurrent")), seed=gguf.require("toy.seed"),
                       max_context_length=context_length or gguf.require("toy.context_length"))
    trunk.trained_context_length = gguf.require("toy.context_length")  # as a real loader reads it
    trunk.tokenizer = Tokenizer.from_gguf(gguf, use_cache=False)
    return trunk
