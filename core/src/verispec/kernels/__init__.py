"""Native code: the C kernels and the build every distribution uses for its own.

- `build.CLibrary`: a named library from a distribution's .c files, compiled once per machine
  into `cache_dir("kernels")` (keyed by sources, flags and CPU), sha256-checked before loading,
  one warning and the PyTorch path when it cannot be built.
- `ckernels`: the kernels the families share (paged attention, the GGUF block matmul, the fused
  decoder layer, GLU, RMSNorm) with their PyTorch statements (`reference_*`); C sources beside it
  (`kernels.c`, `qmatmul.c`, `layers.c`, `kernels.h`).
- `triton_*`: the same contracts in Triton for CUDA tensors (`triton_qmatmul`, `triton_attend`,
  `triton_norm`, `triton_glu`, their shared `triton_math.vexp`; `triton_delta_rule`, the Qwen 3.5
  and GLM-5.3-Flash recurrences' row loop), chosen by `triton_dispatch.use_triton`; tested on the
  CPU under Triton's interpreter.

Order of the layers: kernels ← weights ← nn (nothing here imports those above it).
"""
