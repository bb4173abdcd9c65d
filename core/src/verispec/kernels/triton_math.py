"""Scalar maths shared by the Triton kernels, each the C kernels' own statement step by step.

`vexp()` gives the jitted `vexp` of kernels.c (Cody-Waite range reduction, the cephes expf
polynomial, the argument clamped at -80), which triton_attend's softmax and triton_glu's
activations call: one statement of it in Triton. Built on first use, like the kernels, so that
TRITON_INTERPRET is read as triton is imported; the kernels calling it pass
enable_fp_fusion=False, so each step is one IEEE fp32 operation, as in the C file.
"""
from __future__ import annotations

import functools

__all__ = ["vexp"]


@functools.cache
def vexp():
    """The jitted vexp(x) (fp32 block in, fp32 block out) for a kernel to call. `tl` is a module
    global: a jitted function finds what it calls through its globals."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _vexp(x):
        x = tl.maximum(x, -80.0)
        n = (x * 1.44269504088896341 + 12582912.0) - 12582912.0
        r = x - n * 0.693359375
        r = r - n * -2.12194440e-4
        p = r * 1.9875691500e-4 + 1.3981999507e-3
        p = p * r + 8.3334519073e-3
        p = p * r + 4.1665795894e-2
        p = p * r + 1.6666665459e-1
        p = p * r + 5.0000001201e-1
        y = p * (r * r)
        y = y + r
        y = y + 1.0
        two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        return y * two_n

    return _vexp
