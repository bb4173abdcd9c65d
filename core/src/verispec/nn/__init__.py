"""Shared torch building blocks every model package reuses: the math and the state.

- `norm.RMSNorm`: multiplies by the stored weight (no `1 + w` offset flag).
- `rope.RotaryEmbedding`: neox | normal pairing, partial `rotary_dim`, frequency scaling hooks.
- `attention.attend_rows`: causal / sliding-window GQA of every sequence of a forward over its
  cache, batch-invariant on CPU: one call of the C kernel (`kernels.ckernels`), or the PyTorch
  path (`attention.attend`) where the kernel is unavailable.
- `mlp.GatedMLP`: down(act(gate(x)) * up(x)); `elementwise.rowwise`: a row-at-a-time op.
- `moe`: the sigmoid top-k router with selection bias and expert groups (`TopkRouter`) and the
  weighted expert sum (`routed_experts`), per row (GLM, Nemotron-H MoE).
- `layers`: a decoder layer fused into one C call (`kernels/layers.c`), bitwise the op-by-op forward.
- `kv_cache`: the attention state kinds (`PagedKVCache`, `RingKVCache`, a draft head's `HeadKVCache`).
- `kv_pool`: paged KV on a device: a layer's blocks are rows of one `BlockPool` shared by the trunk's
  sequences; a sequence's `PooledKVCache` holds its blocks' indices (`PagedKVCache`'s semantics).
- `state`: `RecurrentState` and `SequenceState`, which holds a sequence's per-layer state kinds
  and keeps a verify's rows or truncates a prefix.
- `trunk`: the seam written once (`SequenceTrunk`: sequences, batched forward, keep).
- `trunk_module`: the families' nn.Module base on it (`TrunkModule`: sizes, LM head, placement on a device).
- `nextn_head`: a NextN / MTP draft head's bookkeeping (`NextNHead`, `NextNState`: its KV, queued
  catch-up pairs, provisional entries); a family writes only its block's math.
- `parallel`: tensor-parallel shards of the shared layer kinds (column / row / vocabulary-parallel,
  `Shards`); which slice of a stored tensor a rank reads is `verispec.gguf.shard`.

Weight formats live in `verispec.weights`, native code in `verispec.kernels`. Activations
between modules are fp32; only the linears see bf16 or the file's blocks (see `weights.quant`).
"""
