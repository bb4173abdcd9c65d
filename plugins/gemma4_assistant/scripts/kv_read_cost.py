"""Per-step cost of reading the trunk's K/V for one assistant step, by context length:
`TrunkView.kv` (copies the committed cache) against `Gemma4TrunkView.kv_window` (the attended
slots, views where the layout allows), each followed by the step's attention over what it read.
31B-like geometry: sliding layer 16 KV heads x 256, window 1024 (ring of 1024 + 65 - 1 slots);
full layer 4 KV heads x 512, paged in 64-slot blocks; 32 query heads. One thread, fp32.

    python plugins/gemma4_assistant/scripts/kv_read_cost.py
"""
import time

import torch
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.trunk import SequenceTrunkView
from verispec_gemma4.trunk_view import Gemma4TrunkView
from verispec_gemma4_assistant.modeling import attend_kv


class _State:
    def __init__(self, layers, seq_len):
        self.layers, self.seq_len = layers, seq_len


class _Trunk:
    vocab_size, hidden_size = 1, 1

    def __init__(self, state):
        self.state = state

    def _state(self, seq):
        return self.state


def _fill(context):
    ring = RingKVCache(16, 256, window=1024, max_rows=65)
    paged = PagedKVCache(4, 512, max_positions=context)
    paged.ensure_capacity(context)
    for start in range(0, context, 64):
        n = min(64, context - start)
        ring.write(start, torch.randn(n, 16, 256), torch.randn(n, 16, 256))
        paged.write(start, torch.randn(n, 4, 512), torch.randn(n, 4, 512))
    return _Trunk(_State([ring, paged], context))


def _time(fn, repeat=20):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main():
    torch.set_num_threads(1)
    q = {0: torch.randn(1, 32, 256), 1: torch.randn(1, 32, 512)}
    print("context  kv (copy) read+attend ms  kv_window read+attend ms  (sliding + full layer)")
    for context in (1024, 4096, 8192):
        trunk = _fill(context)
        old, new = SequenceTrunkView(trunk), Gemma4TrunkView(trunk)
        first = {0: max(0, context - 1024 - 1), 1: 0}

        def with_kv():
            for layer in (0, 1):
                k, v, p = old.kv(0, layer)
                attend_kv(q[layer], [(k, v, torch.where(p >= first[layer], p, -1))])

        def with_window():
            for layer in (0, 1):
                attend_kv(q[layer], new.kv_window(0, layer, first[layer]))

        print(f"{context:7d}  {_time(with_kv):26.2f}  {_time(with_window):24.2f}")


if __name__ == "__main__":
    main()
