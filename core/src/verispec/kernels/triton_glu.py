"""A gated MLP's act(gate) · up in Triton: `ckernels.reference_glu`'s arithmetic (layers.c's
verispec_silu_mul / verispec_gelu_tanh_mul) on a GPU.

gate_up fp32 [n, 2F] (gate | up) -> fp32 [n, F]. One program per (row, block of columns); per
element g, u, each step one IEEE fp32 operation (the launch passes enable_fp_fusion=False: no
fused multiply-add on the GPU; the divisions are tl.div_rn):
    silu:       e = vexp(-|g|);  out = (g · ((g < 0 ? e : 1) / (1 + e))) · u
    gelu_tanh:  y = 0.7978845608 · (g + 0.044715 · ((g · g) · g));  e = vexp(-|y| · 2)
                t = copysign((1 - e) / (1 + e), y);  out = ((0.5 · g) · (1 + t)) · u
vexp is kernels.c's (Cody-Waite reduction, cephes expf polynomial, its argument clamped at -80):
`triton_math.vexp`, shared with triton_attend. Elementwise: an element's
bits depend on its own g and u alone.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported: the tests' path); `triton_dispatch.use_triton` says which. A trunk
placed on a device (`TrunkModule.to_device`) calls it from `nn.mlp.GatedMLP`.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["glu"]

ACTIVATIONS = ("silu", "gelu_tanh")


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` and `_vexp` are
    module globals: a kernel finds what it calls through its globals."""
    global tl, _vexp
    import triton
    import triton.language as tl

    from verispec.kernels.triton_math import vexp

    _vexp = vexp()

    @triton.jit
    def glu_kernel(gate_up_ptr, out_ptr, F, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        g = tl.load(gate_up_ptr + row * 2 * F + cols, mask=ok, other=0.0)
        u = tl.load(gate_up_ptr + row * 2 * F + F + cols, mask=ok, other=0.0)
        if GELU_TANH:
            y = 0.7978845608 * (g + 0.044715 * ((g * g) * g))
            e = _vexp(-tl.abs(y) * 2.0)
            t = tl.abs(tl.div_rn(1.0 - e, 1.0 + e))
            t = tl.where(y.to(tl.int32, bitcast=True) < 0, -t, t)  # copysign: y's sign bit (-0 included)
            out = ((0.5 * g) * (1.0 + t)) * u
        else:
            e = _vexp(-tl.abs(g))
            out = (g * tl.div_rn(tl.where(g < 0, e, 1.0), 1.0 + e)) * u
        tl.store(out_ptr + row * F + cols, out, mask=ok)

    return glu_kernel


def glu(activation: str, gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """`reference_glu`'s bits on gate_up's device (CUDA, or CPU under TRITON_INTERPRET=1):
    activation "silu" or "gelu_tanh", gate_up fp32 [n, 2 · width] -> fp32 [n, width]. Raises
    ValueError for another activation or a gate_up that is not [n, 2 · width]."""
    import triton

    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
    n = gate_up.shape[0]
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * width:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} does not fit [n, 2 · {width}]")
    out = torch.empty(n, width, dtype=torch.float32, device=gate_up.device)
    if n == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 1024)
    _kernel()[(n, triton.cdiv(width, block))](gate_up.float().contiguous(), out, width,
                                              GELU_TANH=activation == "gelu_tanh", BLOCK=block,
                                              enable_fp_fusion=False)
    return out
