"""The device a trunk runs on: `--device cpu|cuda|auto` and `verispec.load(..., device=)`.

`resolve_device` turns the option into a torch.device (auto: CUDA when torch sees a GPU, else
the CPU) and refuses CUDA where torch sees none, in one line naming the fix. `require_trunk_device`
is the loaders' gate: the trunks run on the CPU; on CUDA only their block-typed linears have a
kernel yet (kernels.triton_qmatmul), so a CUDA trunk is refused, naming what is missing.
"""
from __future__ import annotations

import torch

from verispec.errors import InvalidArgument, VerispecError

__all__ = ["DEVICES", "resolve_device", "require_trunk_device"]

#: the --device choices
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str | None) -> torch.device:
    """"cpu" or None -> cpu; "cuda" -> cuda; "auto" -> cuda when `torch.cuda.is_available()`, else
    cpu. Raises InvalidArgument for another name, and for "cuda" where torch sees no CUDA device."""
    if name is None or name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cuda":
        raise InvalidArgument(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise InvalidArgument(f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device; run on a "
                              "machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu")
    return torch.device("cuda")


def require_trunk_device(device: torch.device) -> None:
    """Raises VerispecError unless the trunks can run on `device` (the CPU, today)."""
    if device.type != "cpu":
        raise VerispecError(f"--device {device.type}: the trunks do not run on {device.type} yet (their block "
                            "matmul has a Triton kernel, their caches, attention and recurrent states are not "
                            "placed on the GPU); use --device cpu")
