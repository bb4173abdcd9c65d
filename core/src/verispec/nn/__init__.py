"""Shared torch building blocks every model package reuses (DESIGN.md §2, STYLE.md §2.4).

- `norm.RMSNorm`: multiplies by the stored weight (no `1 + w` offset flag).
- `rope.RotaryEmbedding`: neox | normal pairing, partial `rotary_dim`, frequency scaling hooks.
- `state`: per-sequence, per-layer state kinds (`PagedKVCache`, `RingKVCache`,
  `RecurrentState`) and `SequenceState`, which keeps a verify's rows or truncates a prefix.
- `trunk`: the seam written once (`SequenceTrunk`: sequences, batched forward, keep) and the
  families' nn.Module base (`TrunkModule`).
- `attention.attend_rows`: causal / sliding-window GQA of every sequence of a forward over its
  cache, batch-invariant on CPU: one call of the C kernel in `ckernels` (built once per
  machine), or the PyTorch path (`attention.attend`) where the kernel is unavailable.
- `quant`: the weight-dtype choice (float32 | bfloat16 | int8) as a linear-module swap.
- `mlp.GatedMLP`: down(act(gate(x)) * up(x)).

Activations between modules are fp32; only the linears see bf16 (see `quant`).
"""
