"""The device a trunk runs on: `--device cpu|cuda|auto` and `verispec.load(..., device=)`.

`resolve_device` turns the option into a torch.device (auto: CUDA when torch sees a GPU, else
the CPU) and refuses CUDA where torch sees none, in one line naming the fix. `require_trunk_device`
is the loaders' gate: every trunk runs on the CPU; a family whose trunk class declares "cuda" in
`devices` (llama/qwen2, Gemma 3, Qwen 3.5: `TrunkModule.to_device` places its weights, pooled KV,
recurrent states and RoPE tables there and runs the Triton kernels) runs on CUDA too, and the
others are refused, naming why.
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


def require_trunk_device(device: torch.device, trunk=None) -> None:
    """Raises VerispecError unless `trunk` (a trunk or its class; None: any trunk) runs on `device`:
    the CPU always, another device where the trunk's `devices` names it."""
    devices = getattr(trunk, "devices", ("cpu",))
    if device.type in devices:
        return
    if trunk is None:
        raise VerispecError(f"--device {device.type}: the trunks do not run on {device.type} yet (only families "
                            "that declare it, llama/qwen2, Gemma 3 and Qwen 3.5 on cuda, do); use --device cpu")
    name = trunk.__name__ if isinstance(trunk, type) else type(trunk).__name__
    raise VerispecError(f"--device {device.type}: the {name} trunk does not run on {device.type} yet (its caches, "
                        f"attention and recurrent states are not placed there; it runs on {', '.join(devices)}; "
                        "llama/qwen2, gemma3 and qwen35 files run on cuda); use --device cpu")
