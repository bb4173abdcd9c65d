"""Gated feed-forward: down(act(gate(x)) * up(x)), HF names gate_proj / up_proj / down_proj.

x: fp32 [n, D] -> fp32 [n, D]; hidden width F. Activations: "gelu_tanh" (Gemma's GeGLU,
gelu_pytorch_tanh), "silu" (llama / qwen SwiGLU). The linears are plain nn.Linear until
`quant.swap_linears` picks the weight dtype. Source: transformers Gemma3MLP / LlamaMLP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.nn.elementwise import rowwise

ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, *, device=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.act_fn = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(rowwise(self.act_fn, self.gate_proj(x)) * self.up_proj(x))  # rowwise: batch-invariant
