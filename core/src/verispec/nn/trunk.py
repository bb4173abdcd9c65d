"""The trunk seam's plumbing, written once: sequences, batching, chunking, logits and taps.

`SequenceTrunk` implements `seams.Trunk` for any trunk whose state is a list of
per-layer state objects (`nn.state`): `new_sequence` / `release` / `seq_len`, `keep`,
`truncate`, `fork`, the batch-shaped `forward` and the read-only `view`. A family writes the math:

    _new_layer_states(self) -> list of nn.state objects (None for a stateless layer), per sequence
    _embed(self, tokens int64 [n]) -> fp32 [n, D]           what the first layer sees
    _forward_rows(self, rows: Rows) -> (normed fp32 [n, D], {layer: residual entering it [n, D]})
    _lm_head(self, normed fp32 [r, D]) -> fp32 [r, V]      (final softcap included)

`forward` packs the segments' rows into chunks of at most `max_rows_per_forward` rows
(a long segment is split across chunks, several short ones share a chunk), runs
`_forward_rows` per chunk, and runs the LM head once per chunk over only the rows that
want logits. With batch-invariant kernels every row is the same bits however the rows are
grouped, so a long prefill, a verify, one-row decodes and B sequences together all agree.

The model families' nn.Module base on top of it is `nn.trunk_module.TrunkModule`.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from verispec.nn.state import SequenceState
from verispec.seams import ContextOverflow, Segment, SegmentOutput, UnsupportedTap


@attrs.frozen
class RowsOfSequence:
    """Rows [begin, end) of a chunk belong to one sequence and sit at positions start_pos..."""

    state: SequenceState
    start_pos: int
    begin: int
    end: int
    #: scratch the layers of this forward share (`attention.attend` keeps its masks here).
    masks: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def rows(self) -> slice:
        return slice(self.begin, self.end)


@attrs.frozen
class Rows:
    """One forward chunk as a family's `_forward_rows` sees it: flat rows of one or more sequences."""

    tokens: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    #: the sequences' row ranges, in order (FlashAttention's cu_seqlens as objects).
    sequences: tuple[RowsOfSequence, ...]


@attrs.define
class _Piece:
    """Rows [offset, offset+n) of batch segment `index`, placed in one chunk."""

    index: int
    offset: int
    n: int
    start_pos: int


class SequenceTrunk:
    """The seam over per-layer state objects. Subclasses set `max_context_length`,
    `max_rows_per_forward`, `vocab_size`, `hidden_size`, `num_layers` and write the math
    (module docstring); `trained_context_length` (the positions the model was trained on)
    where known."""

    max_context_length: int
    trained_context_length: int | None = None
    max_rows_per_forward: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    #: where the trunk's tensors live once `TrunkModule.to_device` placed them; None: the CPU trunk.
    #: Its forwards move the tokens and positions there and the outputs back to the CPU, once each.
    trunk_device: torch.device | None = None

    def __init__(self):
        self._sequences: dict[int, SequenceState] = {}
        self._seq_ids = itertools.count()

    # -- sequences -------------------------------------------------------------------------

    def new_sequence(self) -> int:
        seq = next(self._seq_ids)
        self._sequences[seq] = SequenceState(self._new_layer_states())
        return seq

    def release(self, seq: int) -> None:
        self._sequences.pop(seq, None)

    def seq_len(self, seq: int) -> int:
        return self._state(seq).seq_len

    def keep(self, seq: int, num_rows: int) -> None:
        self._state(seq).keep(num_rows)

    def truncate(self, seq: int, length: int) -> None:
        self._state(seq).truncate(length)

    def fork(self, seq: int, length: int) -> int:
        new = next(self._seq_ids)
        self._sequences[new] = self._state(seq).fork(length)
        return new

    # -- memory ------------------------------------------------------------------------------

    def sequence_nbytes(self, num_positions: int) -> int:
        """Bytes one sequence's state may occupy at `num_positions` positions (the scheduler's
        KV budget reserves this; `SequenceState.max_nbytes` of a template sequence built once
        per context length and forward width, the sizes its states depend on)."""
        key = (self.max_context_length, self.max_rows_per_forward)
        cached = getattr(self, "_nbytes_template", None)
        if cached is None or cached[0] != key:
            cached = self._nbytes_template = (key, SequenceState(self._new_layer_states()))
        return cached[1].max_nbytes(num_positions)

    def sequence_held_nbytes(self, seq: int) -> int:
        """Bytes sequence `seq` holds now (an idle prefix-cache sequence, say)."""
        return self._state(seq).nbytes()

    def _state(self, seq: int) -> SequenceState:
        try:
            return self._sequences[seq]
        except KeyError:
            raise ValueError(f"unknown sequence {seq}: create it with new_sequence() (released ones are gone)") from None

    # -- taps and the view -------------------------------------------------------------------

    def tap_feature_size(self, tap_layers: Sequence[int] | None) -> int:
        """F of a tap: hidden_size for final-normed rows, hidden_size · len(tap_layers) for residuals
        entering those layers (num_layers = after the last). Raises UnsupportedTap."""
        if tap_layers is None:
            return self.hidden_size
        layers = [int(i) for i in tap_layers]
        bad = [i for i in layers if not 0 <= i <= self.num_layers]
        if not layers or bad:
            raise UnsupportedTap(f"hidden taps {layers}: this trunk has layers 0..{self.num_layers - 1} "
                                 f"(and {self.num_layers} for the last residual); got {bad or 'none'}")
        return self.hidden_size * len(layers)

    def view(self) -> SequenceTrunkView:
        return SequenceTrunkView(self)

    # -- the forward -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: Sequence[Segment]) -> list[SegmentOutput]:
        batch = list(batch)
        states = self._check(batch)
        starts = [state.begin(seg.tokens.numel(), verify=seg.verify) for seg, state in zip(batch, states)]
        logits: list[list[torch.Tensor]] = [[] for _ in batch]
        hidden: list[list[torch.Tensor]] = [[] for _ in batch]
        for chunk in self._chunks(batch, starts):
            self._run_chunk(batch, states, chunk, logits, hidden)
        outputs = [SegmentOutput(logits=_cat(lg) if lg else None, hidden=_cat(hd) if seg.hidden else None)
                   for seg, lg, hd in zip(batch, logits, hidden)]
        if self.trunk_device is not None:  # the scheduler, sampler and speculators work on the CPU
            outputs = [SegmentOutput(logits=None if o.logits is None else o.logits.cpu(),
                                     hidden=None if o.hidden is None else o.hidden.cpu()) for o in outputs]
        return outputs

    def _check(self, batch: list[Segment]) -> list[SequenceState]:
        """Validate the whole batch before any state changes."""
        if not batch:
            raise ValueError("a forward needs at least one segment")
        seqs = [seg.seq for seg in batch]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"sequences {seqs}: each sequence may appear once per forward")
        states = [self._state(seq) for seq in seqs]
        for seg, state in zip(batch, states):
            required = state.seq_len + seg.tokens.numel()
            if required > self.max_context_length:
                raise ContextOverflow(required, self.max_context_length, self.trained_context_length)
            if seg.hidden:
                self.tap_feature_size(seg.tap_layers)
        return states

    def _chunks(self, batch: list[Segment], starts: list[int]) -> list[list[_Piece]]:
        """Pack the segments' rows, in order, into chunks of at most max_rows_per_forward rows."""
        chunks, chunk, used = [], [], 0
        for index, (seg, start) in enumerate(zip(batch, starts)):
            offset, n = 0, seg.tokens.numel()
            while offset < n:
                take = min(n - offset, self.max_rows_per_forward - used)
                chunk.append(_Piece(index, offset, take, start + offset))
                offset, used = offset + take, used + take
                if used == self.max_rows_per_forward:
                    chunks.append(chunk)
                    chunk, used = [], 0
        if chunk:
            chunks.append(chunk)
        return chunks

    def _run_chunk(self, batch, states, chunk: list[_Piece], logits, hidden) -> None:
        sequences, tokens, positions, row = [], [], [], 0
        for p in chunk:
            tokens.append(batch[p.index].tokens[p.offset:p.offset + p.n])
            positions.append(torch.arange(p.start_pos, p.start_pos + p.n))
            sequences.append(RowsOfSequence(states[p.index], p.start_pos, row, row + p.n))
            row += p.n
        tokens, positions = _cat(tokens), _cat(positions)
        if self.trunk_device is not None:
            tokens, positions = tokens.to(self.trunk_device), positions.to(self.trunk_device)
        rows = Rows(tokens, positions, tuple(sequences))
        normed, taps = self._forward_rows(rows)
        want, owners = [], []  # chunk rows that want logits, and whose they are
        for p, s in zip(chunk, sequences):
            seg = batch[p.index]
            s.state.seq_len = p.start_pos + p.n
            if seg.logits == "all":
                want.extend(range(s.begin, s.end))
                owners.extend([p.index] * p.n)
            elif seg.logits == "last" and p.offset + p.n == seg.tokens.numel():
                want.append(s.end - 1)
                owners.append(p.index)
            if seg.hidden:
                hidden[p.index].append(normed[s.rows] if seg.tap_layers is None
                                       else torch.cat([taps[i][s.rows] for i in seg.tap_layers], dim=-1))
        if want:
            contiguous = want[-1] - want[0] == len(want) - 1  # always so for one sequence: a view
            head = self._lm_head(normed[want[0]:want[-1] + 1] if contiguous else normed[want])  # [r, V]
            for index, group in itertools.groupby(range(len(owners)), key=owners.__getitem__):
                group = list(group)
                logits[index].append(head[group[0]:group[-1] + 1])

    # -- what a family writes ----------------------------------------------------------------

    def _new_layer_states(self) -> list:
        raise NotImplementedError

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _forward_rows(self, rows: Rows) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        raise NotImplementedError

    def _lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without the copy when there is one piece (every decode and verify: the rows,
    and the logits of a forward that runs in one chunk)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class SequenceTrunkView:
    """The read-only face of a SequenceTrunk (seams.TrunkView) handed to draft heads."""

    def __init__(self, trunk: SequenceTrunk):
        self._trunk = trunk
        self.vocab_size, self.hidden_size = trunk.vocab_size, trunk.hidden_size

    def tap_feature_size(self, tap_layers: Sequence[int] | None) -> int:
        return self._trunk.tap_feature_size(tap_layers)

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._to_cpu(self._trunk._embed(self._on_trunk(torch.as_tensor(tokens, dtype=torch.long).reshape(-1))))

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._to_cpu(self._trunk._lm_head(self._on_trunk(hidden)))

    def _on_trunk(self, x: torch.Tensor) -> torch.Tensor:
        """x on a placed trunk's device (TrunkModule.to_device): a head works on the CPU, as the
        scheduler and sampler do, and reads a placed trunk through this view."""
        device = getattr(self._trunk, "trunk_device", None)
        return x if device is None else x.to(device)

    def _to_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return x if getattr(self._trunk, "trunk_device", None) is None else x.cpu()

    def kv(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The committed attention K/V of `layer` in sequence `seq` (copies: the head cannot change
        the trunk): k, v fp32 [Hkv, T, Dh] and the position each slot holds, int64 [T] (-1 =
        empty; a sliding-window ring holds only the last window). Raises ValueError for a layer
        that stores no KV (a recurrent or KV-shared layer)."""
        state = self._trunk._state(seq)
        cache = state.layers[layer]
        if not hasattr(cache, "key_length"):
            raise ValueError(f"layer {layer} stores no attention KV of its own ({type(cache).__name__})")
        num_slots = cache.key_length(state.seq_len - 1) if state.seq_len else 0
        k, v, positions = cache.read(num_slots)
        positions = torch.where(positions < state.seq_len, positions, -1)
        return self._to_cpu(k.clone()), self._to_cpu(v.clone()), self._to_cpu(positions)
