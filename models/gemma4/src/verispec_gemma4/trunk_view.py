"""The Gemma 4 trunk's read-only view (seams.TrunkView) with a read path for heads that attend
into its KV every draft step (the Gemma 4 assistant).

`SequenceTrunkView.kv` copies a layer's whole committed cache (on the paged layout: every block
gathered, then cloned), so a head calling it per draft step pays the context length in copies
each step. `kv_window` reads only the positions a query attends, copying nothing: a sliding
layer's ring as one chunk of views (its fixed W + R - 1 slots), a paged layer's blocks from the
first attended position on as one chunk of views per key block.

Shape letters: Hkv KV heads, T slots returned, Dh head dim.
"""
from __future__ import annotations

import torch
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.trunk import SequenceTrunkView

__all__ = ["Gemma4TrunkView"]


class Gemma4TrunkView(SequenceTrunkView):
    """`SequenceTrunkView` plus `kv_window`."""

    def kv_window(self, seq: int, layer: int, first_pos: int = 0) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]]:
        """Committed K/V of `layer` in `seq` from position `first_pos` on, as chunks (k, v fp32
        [Hkv, T, Dh], the position of each slot int64 [T], -1 for a slot to ignore: empty,
        uncommitted, before first_pos). Slot order is the cache's, not the positions'.

        The tensors are views of the trunk's cache, nothing is copied: read them before the
        trunk's next forward and never write them. A sliding ring is one chunk of its S slots; a
        paged layer one chunk per key block holding attended positions (none when nothing is
        committed from first_pos). Raises ValueError for a layer that stores no KV of its own (a
        KV-shared layer) and for a negative first_pos."""
        if first_pos < 0:
            raise ValueError(f"first_pos={first_pos}: positions start at 0")
        state = self._trunk._state(seq)
        cache, end = state.layers[layer], state.seq_len
        if isinstance(cache, RingKVCache):
            k, v, tags = cache.read(cache.size)
            return [(k, v, torch.where((tags >= first_pos) & (tags < end), tags, -1))]
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"layer {layer} stores no attention KV of its own ({type(cache).__name__})")
        block = cache.key_block
        chunks = []
        for b in range(min(first_pos, end) // block, -(-end // block)):
            positions = torch.arange(b * block, (b + 1) * block)
            chunks.append((cache.k_blocks[b].transpose(1, 2), cache.v_blocks[b],
                           torch.where((positions >= first_pos) & (positions < end), positions, -1)))
        return chunks
