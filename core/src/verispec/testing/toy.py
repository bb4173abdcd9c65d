"""Tiny trunks and scripted drafters for conformance tests (fp32, CPU, deterministic).

`ToyTarget` is a two-layer model: a recurrent layer (so snapshot/restore is exercised)
then one attention layer over a linear KV cache. Every row is computed with the same
one-row ops whatever n is, so it is batch-invariant by construction: a row inside an
n-row verify is bitwise the row computed alone.

Shape letters: n rows, V vocabulary, D width, S cache capacity.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.seams import ContextOverflow, Speculator, UnsupportedTap, VerifyOutput


class ToyTarget:
    spec_batch_invariant = True
    spec_verify_persists_accepted_kv = True

    def __init__(self, vocab_size: int = 32, dim: int = 16, *, recurrent: bool = True,
                 max_context_length: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale  # noqa: E731
        self.vocab_size, self.dim = vocab_size, dim
        self.embed = rand(vocab_size, dim)  # [V, D]
        self.recurrent_a = rand(dim, dim, scale=0.5 / dim ** 0.5)  # [D, D]
        self.wq, self.wk, self.wv = (rand(dim, dim, scale=dim ** -0.5) for _ in range(3))
        self.lm_head = rand(vocab_size, dim, scale=2.0)  # [V, D]: sharp logits, few near-ties
        self.spec_has_recurrent_state = recurrent
        self.max_context_length = max_context_length
        self.spec_feature_size = dim
        self._taps: tuple[int, ...] | None = None
        self.k_cache = torch.zeros(max_context_length, dim)  # [S, D]
        self.v_cache = torch.zeros(max_context_length, dim)
        self.state = torch.zeros(dim)  # [D] recurrent state
        self._snapshot = None
        self.cache_seq_len = 0
        self.num_forwards = 0

    # -- the math, one row at a time ----------------------------------------------------

    def _row(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual entering each layer [2, D] and the final row [D] for one token at `pos`."""
        x = self.embed[token]
        if self.spec_has_recurrent_state:
            self.state = torch.tanh(self.recurrent_a @ self.state + x)
            h = x + self.state
        else:
            h = x
        self.k_cache[pos] = self.wk @ h
        self.v_cache[pos] = self.wv @ h
        scores = self.k_cache[:pos + 1] @ (self.wq @ h) / self.dim ** 0.5  # [pos+1]
        out = h + torch.softmax(scores, dim=0) @ self.v_cache[:pos + 1]
        return torch.stack([x, h]), out

    def spec_forward(self, tokens: torch.Tensor, *, hidden: bool, all_logits: bool) -> VerifyOutput:
        n = len(tokens)
        if self.cache_seq_len + n > self.max_context_length:
            raise ContextOverflow(self.cache_seq_len + n, self.max_context_length)
        self.num_forwards += 1
        taps, finals = [], []
        for i, token in enumerate(tokens.tolist()):
            entering, final = self._row(token, self.cache_seq_len + i)
            taps.append(entering[list(self._taps)].reshape(-1) if self._taps else final)
            finals.append(final)
        self.cache_seq_len += n
        rows = finals if all_logits else finals[-1:]
        logits = torch.stack([self.lm_head @ r for r in rows])  # [n or 1, V]
        return VerifyOutput(logits=logits, hidden=torch.stack(taps) if hidden else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.spec_forward(tokens, hidden=False, all_logits=False).logits[0]

    # -- cache seams ----------------------------------------------------------------------

    def spec_ensure_capacity(self, required_len: int) -> None:
        if required_len > self.max_context_length:
            raise ContextOverflow(required_len, self.max_context_length)

    def spec_rewind_cache(self, length: int) -> None:
        if not 0 <= length <= self.cache_seq_len:
            raise ValueError(f"rewind to {length} outside [0, {self.cache_seq_len}]")
        self.cache_seq_len = length
        if length == 0:
            self.state = torch.zeros(self.dim)

    def spec_snapshot_recurrent_state(self) -> None:
        self._snapshot = self.state.clone()

    def spec_restore_recurrent_state(self) -> None:
        self.state = self._snapshot.clone()

    def spec_set_hidden_taps(self, layers: Sequence[int] | None) -> None:
        """Tap the residuals entering `layers` (0 = embedding, 1 = attention input), concatenated."""
        if layers is not None and any(not 0 <= layer < 2 for layer in layers):
            raise UnsupportedTap(f"toy trunk has layers 0..1, asked for {list(layers)}")
        self._taps = tuple(layers) if layers else None
        self.spec_feature_size = self.dim * (len(self._taps) if self._taps else 1)

    def reset(self) -> None:
        self.spec_rewind_cache(0)


class MarkovTarget:
    """Logits depend only on the previous token: logits[t] = table[token_{t}] (fp32 [V, V]).

    Cheap enough for 100k-draw distribution tests; batch-invariant (pure indexing).
    """

    spec_batch_invariant = True
    spec_feature_size = 1

    def __init__(self, table: torch.Tensor, max_context_length: int = 1 << 20):
        self.table = table.float()
        self.vocab_size = table.shape[0]
        self.max_context_length = max_context_length
        self.cache_seq_len = 0

    def spec_forward(self, tokens, *, hidden, all_logits):
        if self.cache_seq_len + len(tokens) > self.max_context_length:
            raise ContextOverflow(self.cache_seq_len + len(tokens), self.max_context_length)
        self.cache_seq_len += len(tokens)
        logits = self.table[tokens] if all_logits else self.table[tokens[-1:]]
        return VerifyOutput(logits=logits)

    def forward(self, tokens):
        return self.spec_forward(tokens, hidden=False, all_logits=False).logits[0]

    def spec_ensure_capacity(self, required_len):
        if required_len > self.max_context_length:
            raise ContextOverflow(required_len, self.max_context_length)

    def spec_rewind_cache(self, length):
        self.cache_seq_len = length

    def spec_snapshot_recurrent_state(self):
        pass

    def spec_restore_recurrent_state(self):
        pass


class ScriptedSpeculator(Speculator):
    """Proposes from a script: `script(ctx) -> list[int]`. Tracks what it was committed."""

    name = "scripted"

    def __init__(self, script, *, max_draft_tokens: int = 8, needs_hidden_state: bool = False):
        super().__init__(max_draft_tokens=max_draft_tokens)
        self.script = script
        self.needs_hidden_state = needs_hidden_state
        self.committed: list[int] = []
        self.hidden_rows: list = []

    def propose(self, ctx):
        return list(self.script(ctx))[:ctx.draft_window]

    def commit(self, tokens, hidden_rows, start_pos):
        if start_pos != len(self.committed):
            raise AssertionError(f"commit at {start_pos} but {len(self.committed)} tokens committed")
        self.committed.extend(tokens)
        if hidden_rows is not None:
            self.hidden_rows.extend(hidden_rows)

    def reset(self):
        self.committed.clear()
        self.hidden_rows.clear()


def oracle_speculator(reference: Sequence[int], *, correct: int | None = None, vocab_size: int,
                      max_draft_tokens: int = 8, rng=None) -> ScriptedSpeculator:
    """Drafts from the plain stream `reference` (prompt + output, by position).

    correct=None: every draft right (a perfect drafter). correct=0: every draft wrong.
    rng: a random.Random choosing how many drafts are right each step (random accept counts).
    """
    def script(ctx):
        want = list(reference[ctx.pos + 1:ctx.pos + 1 + ctx.draft_window])
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


def load_toy_gguf(path, *, dtype=None, context_length=None) -> ToyTarget:
    """TargetSpec loader for `write_toy_gguf` files."""
    from verispec.gguf_io import GGUFFile
    from verispec.tokenizer import Tokenizer

    gguf = GGUFFile.open(path)
    target = ToyTarget(gguf.require("toy.vocab_size"), gguf.require("toy.embedding_length"),
                       recurrent=bool(gguf.require("toy.recurrent")), seed=gguf.require("toy.seed"),
                       max_context_length=context_length or gguf.require("toy.context_length"))
    target.tokenizer = Tokenizer.from_gguf(gguf, use_cache=False)
    return target


class ToyBatchedTarget:
    """BatchedSpeculativeTarget over B slots, each its own ToyTarget state (same weights).

    The toy has no paged cache; it exists so `BatchedSpecTrunk` and the batched seam are
    exercised before a real model ships one.
    """

    spec_batch_invariant = True
    spec_verify_persists_accepted_kv = True

    def __init__(self, num_slots: int, **toy_kwargs):
        self.slots = [ToyTarget(**toy_kwargs) for _ in range(num_slots)]
        first = self.slots[0]
        self.max_context_length, self.vocab_size = first.max_context_length, first.vocab_size
        self.spec_feature_size = first.spec_feature_size
        self.spec_has_recurrent_state = first.spec_has_recurrent_state

    def spec_slot_seq_len(self, slot):
        return self.slots[slot].cache_seq_len

    def spec_forward_batch(self, slots, tokens, *, hidden, all_logits):
        return [self.slots[s].spec_forward(t, hidden=hidden, all_logits=all_logits) for s, t in zip(slots, tokens)]

    def spec_rewind_slot(self, slot, length):
        self.slots[slot].spec_rewind_cache(length)

    def spec_snapshot_slot(self, slot):
        self.slots[slot].spec_snapshot_recurrent_state()

    def spec_restore_slot(self, slot):
        self.slots[slot].spec_restore_recurrent_state()
