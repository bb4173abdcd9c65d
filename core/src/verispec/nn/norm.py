"""RMSNorm that multiplies by the stored weight.

Families differ in what they store, not in how the norm runs: gemma/gemma2/gemma3 and
qwen35 GGUFs already hold `1 + w` (llama.cpp's converter adds the 1), gemma4 holds `w`,
llama holds `w`. So there is no offset flag here; the difference lives in each family's
HF -> GGUF conversion (docs/reference/gemma4.md §2.1, §8.1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import ckernels, triton_dispatch, triton_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x², last dim) + eps) · weight, computed in fp32.

    x: [..., dim] any float dtype -> fp32 [..., dim]. `with_weight=False` gives the plain
    normalisation (Gemma 4's v_norm and router norm have no weight).
    Per-row: a row's result never depends on the other rows (batch-invariant). Runs the C
    kernel (`ckernels.rms_norm`, its reduction order fixed) where built, else torch's rms_norm;
    on a device (`device_kernels`) the same bits from `kernels.triton_norm.rms_norm` where
    `triton_dispatch.use_triton`, else from the C kernel's PyTorch statement.
    Source: transformers Gemma3RMSNorm (normalise in fp32, then scale; PR #29402).
    """

    #: set by `TrunkModule.to_device`: the C kernel's bits on the tensors' device instead of the C
    #: kernel: the Triton kernel (`triton_norm.rms_norm`), or its PyTorch statement (`reference_rms_norm`)
    device_kernels = False

    def __init__(self, dim: int, eps: float = 1e-6, *, with_weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.device_kernels:
            rows = x.float().reshape(-1, self.dim)
            if triton_dispatch.use_triton(rows):  # CUDA tensors: the C kernel's arithmetic in Triton
                return triton_norm.rms_norm(rows, self.weight, self.eps).view(x.shape)
            return ckernels.reference_rms_norm(rows, self.weight, self.eps).view(x.shape)
        if ckernels.library() is not None:  # one C call: ~3 µs against ~13 for torch's composite op
            return ckernels.rms_norm(x.float().contiguous(), self.weight, self.eps)
        return F.rms_norm(x.float(), (self.dim,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, with_weight={self.weight is not None}"
