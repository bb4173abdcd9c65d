"""When the Triton kernels run: `use_triton(x)` for a tensor about to enter a kernel.

VERISPEC_TRITON unset: on CUDA tensors. `0`: never (the PyTorch statement of each kernel runs on
the GPU instead). `1`: also on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1,
set before triton is imported: how the tests run them without a GPU; a process that merely has
the interpreter on keeps its CPU paths). Without the `triton` package they never run.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["available", "use_triton"]


@functools.cache
def available() -> bool:
    """Whether the `triton` package imports (pip install triton; wheels for Linux x86_64 / aarch64)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def use_triton(x: torch.Tensor) -> bool:
    """True when a kernel given `x` should be the Triton one (module docstring). Raises ValueError
    for a VERISPEC_TRITON other than 0 or 1."""
    switch = os.environ.get("VERISPEC_TRITON")
    if switch is None:  # the default, first: a CPU forward asks ~100 times a token
        return x.is_cuda and available()
    if switch not in ("0", "1"):
        raise ValueError(f"VERISPEC_TRITON={switch!r}: set it to 0 (the PyTorch path on the GPU) or 1 (the "
                         "Triton kernels, also on CPU tensors under TRITON_INTERPRET=1), or leave it unset")
    if switch == "0" or not available():
        return False
    return x.is_cuda or _interpreting()
