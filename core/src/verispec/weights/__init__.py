"""Weight formats: how a linear holds its weight and multiplies by it.

- `quant`: the weight-dtype choice (float32 | bfloat16 | int8) as a linear-module swap, and the
  `GGUFLinear` placeholder / `PartwiseLinear` (a stack of parts of different classes).
- `gguf_blocks`: GGUF's block formats (Q4_0 … Q8_0) as data: `GGUFBlocks` (ggml type + raw
  bytes) and their dequantisation, gguf-py's values bitwise.
- `block_linear`: the `gguf` weight mode's linears, multiplying by the file's own blocks
  through `kernels.ckernels.qmatmul` (PyTorch path: `reference_matmul`).
- `gguf_mode`: the `gguf` mode's resolution of each placeholder to the class for its ggml types.
"""
