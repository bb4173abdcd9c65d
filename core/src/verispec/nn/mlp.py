"""Gated feed-forward: down(act(gate(x)) * up(x)); HF's gate_proj / up_proj held as one
linear `gate_up_proj` [2F, D] (gate rows first), down_proj as HF names it.

x: fp32 [n, D] -> fp32 [n, D]; hidden width F. Activations: "gelu_tanh" (Gemma's GeGLU,
gelu_pytorch_tanh), "silu" (llama / qwen SwiGLU). The linears are plain nn.Linear until
`quant.swap_linears` picks the weight dtype. Source: transformers Gemma3MLP / LlamaMLP.

gate|up as one linear: a family's tensor table reads it as `Stack(ffn_gate, ffn_up)`, and
`part_rows` declares the two halves. One matmul call instead of two, which on a one-row decode
is mostly per-call overhead (SmolLM2 shapes, int4, one thread: ~67 vs ~72 us; int8 58 vs 74
us). Every weight dtype quantises per output row, so the stacked rows hold the values the two
linears would, and the output is bitwise theirs (core/tests/test_nn.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import ckernels, triton_dispatch, triton_glu
from verispec.nn.elementwise import rowwise

ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class GatedMLP(nn.Module):
    """kernel_activation: compute act(gate) · up with the C kernels' `ckernels.glu` where they
    are built (its own exp), as a family's fused layers (nn.layers) do, so its op-by-op forward
    gives their bits; otherwise torch's activation. On a device (`device_kernels`) the same bits
    from `kernels.triton_glu.glu` where `triton_dispatch.use_triton`, else from the C kernel's
    PyTorch statement."""

    #: set by `TrunkModule.to_device`: the C kernel's bits on the tensors' device where the C kernel
    #: would run: the Triton kernel (`triton_glu.glu`), or its PyTorch statement (`ckernels.reference_glu`)
    device_kernels = False

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, *, kernel_activation: bool = False,
                 device=None):
        super().__init__()
        self.kernel_activation = kernel_activation
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.act_fn = ACTIVATIONS[activation]
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, device=device)
        self.part_rows = {"gate_up_proj": (intermediate_size, intermediate_size)}
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel_activation and self.device_kernels:
            rows = gate_up.reshape(-1, 2 * self.intermediate_size)
            glu = triton_glu.glu if triton_dispatch.use_triton(rows) else ckernels.reference_glu
            act = glu(self.activation, rows, self.intermediate_size)
            return self.down_proj(act.view(*x.shape[:-1], -1))
        if self.kernel_activation and ckernels.library() is not None:
            act = ckernels.glu(self.activation, gate_up.reshape(-1, 2 * self.intermediate_size).contiguous(),
                               self.intermediate_size)
            return self.down_proj(act.view(*x.shape[:-1], -1))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(rowwise(self.act_fn, gate) * up)  # rowwise: batch-invariant
