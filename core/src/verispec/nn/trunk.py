"""`KVTrunk`: the SpeculativeTarget plumbing every attention-only trunk would otherwise copy.

A model package subclasses it and writes the math of one forward chunk:

    def _forward_chunk(self, tokens, start_pos, *, logit_rows, hidden) -> (logits, taps)

tokens int64 [n] (n <= max_rows_per_forward) at positions start_pos.., K/V written into
`self.kv_cache`; `logit_rows` is "last", "all" or None; returns logits fp32 [1 | n, V]
(or None) and the hidden tap rows [n, F] (or None). This base class splits longer inputs
into chunks, checks the context, keeps `cache_seq_len`, and implements the seam
(forward, spec_forward, capacity, rewind, no-op recurrent snapshot, declarations).

Splitting is exact for batch-invariant kernels: each row is the same bits however the
rows are grouped, so a long prefill, a verify and one-row decodes all agree.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from verispec.nn.kv_cache import ModelKVCache
from verispec.nn.quant import canonical_dtype, module_batch_invariant, rows_per_forward, swap_linears
from verispec.seams import ContextOverflow, UnsupportedTap, VerifyOutput


class KVTrunk(nn.Module):
    """Base for trunks whose only state is a `ModelKVCache` (set `self.kv_cache` in __init__).

    Subclasses also set `max_context_length`, `max_rows_per_forward`, `vocab_size`,
    `hidden_size`, `num_layers`, and implement `_forward_chunk`.
    """

    # A verify's rows land in the cache exactly as decodes would put them, so rollback is a
    # rewind (rings are sized window + max_rows - 1; see kv_cache).
    spec_verify_persists_accepted_kv = True
    spec_has_recurrent_state = False
    spec_plain_step_uses_forward = True
    speculation_refusal = None
    speculation_profitable = True

    kv_cache: ModelKVCache
    max_context_length: int
    max_rows_per_forward: int
    tokenizer = None
    #: layers whose *entering* residual rows form the hidden tap; None = final-normed rows.
    hidden_tap_layers: tuple[int, ...] | None = None

    # -- declarations --

    @property
    def spec_batch_invariant(self) -> bool:
        """True when every linear uses a batch-invariant kernel (nn.quant) and no forward chunk
        exceeds the kernels' invariance limit. Computed once: the loop reads it often."""
        if self.__dict__.get("_batch_invariant") is None:
            limits = [m.max_invariant_rows for m in self.modules() if getattr(m, "max_invariant_rows", None)]
            self._batch_invariant = module_batch_invariant(self) and all(
                self.max_rows_per_forward <= limit for limit in limits)
        return self._batch_invariant

    @property
    def spec_feature_size(self) -> int:
        taps = self.hidden_tap_layers
        return self.hidden_size if taps is None else self.hidden_size * len(taps)

    def spec_set_hidden_taps(self, layers: Sequence[int] | None) -> None:
        """Tap the residual rows entering `layers` (concatenated, [n, D·len]); None = final-normed rows.
        Layer index num_layers means the residual after the last layer. Raises UnsupportedTap."""
        if layers is None:
            self.hidden_tap_layers = None
            return
        layers = tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i <= self.num_layers]
        if not layers or bad:
            raise UnsupportedTap(f"hidden taps {list(layers)}: this trunk has layers 0..{self.num_layers - 1} "
                                 f"(and {self.num_layers} for the last residual); got {bad or 'none'}")
        self.hidden_tap_layers = layers

    def _init_sizes(self, config, dtype: str, max_rows_per_forward: int | None, context_length: int | None) -> None:
        """The sizes the seam reads, from an HF-style config (vocab_size, hidden_size,
        num_hidden_layers, max_position_embeddings); call first in a subclass's __init__."""
        self.config, self.dtype = config, canonical_dtype(dtype)
        self.vocab_size, self.hidden_size, self.num_layers = (config.vocab_size, config.hidden_size,
                                                              config.num_hidden_layers)
        self.max_context_length = int(context_length or config.max_position_embeddings)
        self.max_rows_per_forward = max_rows_per_forward or rows_per_forward(self.dtype)

    def _finish_linears(self, device) -> None:
        """Add the untied LM head when the config has one (else `model.embed_tokens` serves), then
        swap every linear to the weight dtype; call once `self.model` is built."""
        c = self.config
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False,
                                                                    device=device)
        swap_linears(self, self.dtype)

    def _logits_and_taps(self, normed: torch.Tensor, taps: dict[int, torch.Tensor], *, logit_rows: str | None,
                         hidden: bool, softcap: float | None = None):
        """The end of every `_forward_chunk`: logits fp32 [n | 1, V] of the rows asked for
        (tied to `model.embed_tokens` unless `self.lm_head`), with Gemma's final softcap
        cap·tanh(x/cap) when given; and the hidden tap: final-normed rows [n, D], or the
        residuals entering `hidden_tap_layers` concatenated [n, D·taps]."""
        logits = None
        if logit_rows is not None:
            head = self.model.embed_tokens if self.lm_head is None else self.lm_head
            logits = head(normed if logit_rows == "all" else normed[-1:])  # [n | 1, V]
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
        if not hidden:
            return logits, None
        if self.hidden_tap_layers is None:
            return logits, normed
        return logits, torch.cat([taps[i] for i in self.hidden_tap_layers], dim=-1)  # [n, D·taps]

    # -- cache --

    @property
    def cache_seq_len(self) -> int:
        return self.kv_cache.seq_len

    def spec_ensure_capacity(self, required_len: int) -> None:
        if required_len > self.max_context_length:
            raise ContextOverflow(required_len, self.max_context_length)
        self.kv_cache.ensure_capacity(required_len)

    def spec_rewind_cache(self, length: int) -> None:
        """Keep positions [0, length). Raises kv_cache.RewindBeyondWindow (a ValueError) when a
        sliding-window ring no longer holds what position `length` would attend to."""
        self.kv_cache.rewind(length)

    def spec_snapshot_recurrent_state(self) -> None:
        pass  # attention KV only

    def spec_restore_recurrent_state(self) -> None:
        pass

    def reset(self) -> None:
        """Empty the cache."""
        self.kv_cache.reset()

    # -- forwards --

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain prefill/decode: append int64 [n] tokens, return fp32 [V] logits of the last row."""
        logits, _ = self._run(tokens, logit_rows="last", hidden=False)
        return logits[0]

    @torch.no_grad()
    def spec_forward(self, tokens: torch.Tensor, *, hidden: bool, all_logits: bool) -> VerifyOutput:
        """Append n rows at cache_seq_len in one call.

        tokens: int64 [n], n >= 1. hidden: also return the tapped rows [n, F] fp32.
        all_logits: logits fp32 [n, V] for every row, else only the last ([1, V]).
        Raises ContextOverflow when cache_seq_len + n > max_context_length.
        """
        logits, taps = self._run(tokens, logit_rows="all" if all_logits else "last", hidden=hidden)
        return VerifyOutput(logits=logits, hidden=taps)

    def _run(self, tokens: torch.Tensor, *, logit_rows: str, hidden: bool):
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = tokens.numel()
        if n == 0:
            raise ValueError("a forward needs at least one token")
        start = self.cache_seq_len
        self.spec_ensure_capacity(start + n)
        step = self.max_rows_per_forward
        logits, taps = [], []
        for begin in range(0, n, step):
            chunk = tokens[begin:begin + step]
            is_last = begin + step >= n
            rows = logit_rows if (logit_rows == "all" or is_last) else None
            chunk_logits, chunk_taps = self._forward_chunk(chunk, start + begin, logit_rows=rows, hidden=hidden)
            self.kv_cache.seq_len = start + begin + chunk.numel()
            if chunk_logits is not None:
                logits.append(chunk_logits)
            if chunk_taps is not None:
                taps.append(chunk_taps)
        return torch.cat(logits), (torch.cat(taps) if hidden else None)

    def _forward_chunk(self, tokens: torch.Tensor, start_pos: int, *, logit_rows: str | None, hidden: bool):
        raise NotImplementedError
