"""The Python API: `verispec.load(model, ...)` → an InferenceEngine (mirrors the CLI)."""
from __future__ import annotations

import logging
import math
import numbers

from verispec.model_files import load_registered_trunk, resolve_model_path
from verispec.registry import Registry

__all__ = ["load", "load_registered_trunk", "resolve_model_path", "kv_budget_bytes", "available_memory_bytes"]

log = logging.getLogger("verispec")


def available_memory_bytes(device=None) -> int | None:
    """Bytes free for KV: on a CUDA device (a torch.device) its free memory now
    (`torch.cuda.mem_get_info`), else MemAvailable from /proc/meminfo; None where it cannot be read."""
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_budget_bytes(kv_cache_gb: float | None, device=None) -> int | None:
    """The scheduler's KV budget: kv_cache_gb GiB; 0 = no budget; None = half of the memory
    available now on the trunk's device (`available_memory_bytes(device)`; measured once the model
    is loaded and placed), or no budget where that is unknown."""
    from verispec.errors import InvalidArgument

    if kv_cache_gb is None:
        available = available_memory_bytes(device)
        return available // 2 if available else None
    usage = "give GiB (2^30 bytes) > 0 (--kv-cache-gb / kv_cache_gb=), 0 for no budget, or leave it unset for the default"
    if isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, numbers.Real):
        raise InvalidArgument(f"kv_cache_gb={kv_cache_gb!r}: {usage}")
    if not 0 <= kv_cache_gb < math.inf:
        raise InvalidArgument(f"kv_cache_gb={kv_cache_gb}: {usage}")
    if kv_cache_gb == 0:
        return None
    budget = int(kv_cache_gb * 2**30)
    if budget < 1:
        raise InvalidArgument(f"a KV budget of {kv_cache_gb} GiB is under one byte; {usage}")
    available = available_memory_bytes(device)
    if available is not None and budget > available:
        where = "GPU memory" if device is not None and device.type == "cuda" else "memory"
        log.warning("a KV budget of %.3g GiB is more than the %.3g GiB of %s available now: a full budget "
                    "would run out of it; lower --kv-cache-gb", budget / 2**30, available / 2**30, where)
    return budget


def load(model: str | None = None, *, dtype: str | None = None, threads: int | str | None = None,
         context_length: int | None = None, spec=None, registry: Registry | None = None,
         prefill_chunk: int | None = None, max_running: int | None = None, kv_cache_gb: float | None = None,
         tensor_parallel: int | None = None, device: str | None = None, **spec_options):
    """Load `model` and return an InferenceEngine.

    model: GGUF path, checkpoint alias (e.g. "gemma3-270m"), or None for the default.
    spec: a SpecOptions, or pass its fields as keywords (spec_type="ngram", max_draft_tokens=8, ...).
    prefill_chunk, max_running: the engine's rows per step and concurrent requests (None = its defaults).
    kv_cache_gb: GiB of KV/state memory for running and idle sequences (verispec.kv_budget); a
      request that does not fit waits. None = half of the memory available once the model is
      loaded (on "cuda": the GPU's free memory once the trunk is placed); 0 = no budget.
    tensor_parallel: ranks of a tensor-parallel trunk (verispec.tensor_parallel; None or 1: one process).
    device: "cpu" (None: the default), "cuda" or "auto" (verispec.device.resolve_device); off the
      CPU `dtype` defaults to "gguf" and int8 / int4 are refused before the model loads.
      On "cuda" the trunk is placed there by `TrunkModule.to_device` (the families that
      declare it; README "GPUs"); the scheduler, sampler and speculators stay on the CPU.
    Raises InvalidArgument when both `spec` and its fields as keywords are given, or for a device
    torch does not see; VerispecError for a device the file's trunk does not run on.
    """
    from verispec.engine import InferenceEngine, SpecOptions
    from verispec.errors import InvalidArgument

    if spec is not None and spec_options:
        raise InvalidArgument(f"give either spec= or its fields as keywords ({', '.join(spec_options)}), not both")
    from verispec.device import require_trunk_device, resolve_device

    device = resolve_device(device)  # a device torch does not see is refused before the model loads
    if device.type != "cpu" and tensor_parallel and tensor_parallel > 1:
        raise InvalidArgument(f"--device {device.type} with --tp {tensor_parallel}: tensor-parallel ranks run on the "
                              "CPU; leave one of them out")
    if device.type != "cpu":  # on a GPU the block kernels run in Triton: the file's own blocks, refused dtypes first
        dtype = dtype or "gguf"
        if dtype in ("int8", "i8", "int4", "i4"):
            raise InvalidArgument(f"--dtype {dtype} on {device.type}: its packed-integer kernels run on the CPU; on "
                                  f"{device.type} use --dtype gguf (the default there) or bf16 / fp32 (cuBLAS: not "
                                  "batch-invariant, declared so)")
    budget = kv_budget_bytes(kv_cache_gb) if kv_cache_gb is not None else None  # refused before the model loads
    registry = registry or Registry.discover()
    spec = spec or SpecOptions(**spec_options)
    trunk = load_registered_trunk(resolve_model_path(model, registry), registry, dtype=dtype, threads=threads,
                         context_length=context_length, tensor_parallel=tensor_parallel)
    if device.type != "cpu":
        require_trunk_device(device, trunk)  # the family's declaration (TrunkModule.devices)
        trunk.to_device(device)
        from verispec.weights.block_linear import BlockLinear

        for module in trunk.modules():  # the weights' device copies now, so the KV budget sees them
            if isinstance(module, BlockLinear):
                module.device_weight(device)
    engine_options = {k: v for k, v in (("prefill_chunk", prefill_chunk), ("max_running", max_running))
                      if v is not None}
    if kv_cache_gb is None:
        budget = kv_budget_bytes(None, device)  # half of what the loaded (and placed) model left available
    elif device.type != "cpu":
        budget = kv_budget_bytes(kv_cache_gb, device)  # warns against the GPU's memory, not the host's
    return InferenceEngine(trunk, registry=registry, spec=spec, kv_budget_bytes=budget,
                           **engine_options)
