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
- `state`: `RecurrentState` and `SequenceState`, which holds a sequence's per-layer state kinds
  and keeps a verify's rows or truncates a prefix.
- `trunk`: the seam written once (`SequenceTrunk`: sequences, batched forward, keep) and the
  families' nn.Module base (`TrunkModule`).

Weight formats live in `verispec.weights`, native code in `verispec.kernels`. Activations
between modules are fp32; only the linears see bf16 or the file's blocks (see `weights.quant`).
"""
