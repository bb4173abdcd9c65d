"""The Gemma 4 trunk's read-only view (seams.TrunkView) with a read path for heads that attend
into its KV every draft step (the Gemma 4 assistant).

`SequenceTrunkView.kv` copies a layer's whole committed cache (on the paged layout: every block
gathered, then cloned), so a head calling it per draft step pays the context length in copies
each step. `kv_window` reads only the positions a query attends: a sliding layer's ring as views
(its fixed W + R - 1 slots, nothing copied), a paged layer's blocks from the first attended
position on (a view when they fit in one block, else one gather of those blocks).

Shape letters: Hkv KV heads, T slots returned, Dh head dim.
"""
from __future__ import annotations

import torch
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.trunk import SequenceTrunkView

__all__ = ["Gemma4TrunkView"]


class Gemma4TrunkView(SequenceTrunkView):
    """`SequenceTrunkView` plus `kv_window`."""

    def kv_window(self, seq: int, layer: int, first_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Committed K/V of `layer` in `seq` from position `first_pos` on: k, v fp32 [Hkv, T, Dh]
        and the position of each slot, int64 [T], -1 for a slot to ignore (empty, uncommitted,
        before first_pos). Slot order is the cache's, not the positions'.

        The tensors are views of the trunk's cache where the layout allows (a ring; a paged
        range within one key block): read them before the trunk's next forward and never write
        them. T is the ring size on sliding layers, the attended positions rounded out to key
        blocks on paged ones. Raises ValueError for a layer that stores no KV of its own (a
        KV-shared layer) and for a negative first_pos."""
        if first_pos < 0:
            raise ValueError(f"first_pos={first_pos}: positions start at 0")
        state = self._trunk._state(seq)
        cache, end = state.layers[layer], state.seq_len
        if isinstance(cache, RingKVCache):
            k, v, tags = cache.read(cache.size)
            return k, v, torch.where((tags >= first_pos) & (tags < end), tags, -1)
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"layer {layer} stores no attention KV of its own ({type(cache).__name__})")
        block = cache.key_block
        first, last = min(first_pos, end) // block, -(-end // block)
        if last <= first:
            empty = torch.zeros(cache.num_kv_heads, 0, cache.head_dim)
            return empty, empty, torch.zeros(0, dtype=torch.long)
        if last - first == 1:
            k, v = cache.k_blocks[first].transpose(1, 2), cache.v_blocks[first]
        else:
            k = torch.cat(cache.k_blocks[first:last], dim=2).transpose(1, 2)
            v = torch.cat(cache.v_blocks[first:last], dim=1)
        positions = torch.arange(first * block, last * block)
        return k, v, torch.where((positions >= first_pos) & (positions < end), positions, -1)
