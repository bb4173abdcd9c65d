"""Converted-weight cache: a model's state dict after dequantise + requantise, saved once.

Dequantising Q4_K/Q5_0 and requantising to the weight dtype takes seconds; a model package
calls `cached_state(gguf, dtype, convert)` and the next load memory-maps the saved state
(`torch.load(mmap=True)`, ~0.3 s). Entries live under `cache_dir("weights")` (listed and
cleared by `verispec cache`), keyed by the file's content (see `content_key`), so a file
rewritten in place with other weights never hits a stale entry. Each entry's sha256 is saved
beside it and checked before it is read (`cache_digest`: 0.16 s for a 253 MB state), so a
damaged entry, even one that still loads, is a miss: deleted, logged once, converted again.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verispec import cache_digest
from verispec.gguf.io import GGUFFile

#: bump when a converted layout changes: older entries are then ignored.
CACHE_FORMAT = 2
#: conversions faster than this (seconds) are not worth a cache file.
MIN_CONVERT_SECONDS = 1.0


def cached_state(gguf: GGUFFile, dtype: str, convert: Callable[[], dict[str, torch.Tensor]], *,
                 use_cache: bool = True, layout: str = "") -> dict[str, torch.Tensor]:
    """The converted state of `gguf` in `dtype`: from the cache, else `convert()` (then saved).

    layout: a family's own version tag for its converted layout (part of the key).
    A damaged entry (its sha256 differs from the one saved with it, or it does not load)
    counts as a miss: it is deleted with one logged warning and converted again. A cache that
    cannot be written (read-only, full) costs one warning per process: the state is used uncached.
    """
    path = _cache_file(gguf, dtype, layout) if use_cache else None
    if path is not None:
        from verispec.checkpoints import remove_stale_partials

        remove_stale_partials(path.parent)  # a run killed while saving left a .partial
    if path is not None and cache_digest.intact(path, "converted weights"):
        try:
            return torch.load(path, mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 -- torch.load raises many types; a damaged entry is a miss
            cache_digest.discard(path, "converted weights", f"does not load ({type(e).__name__})")
    started = time.perf_counter()
    state = convert()
    if path is not None and time.perf_counter() - started > MIN_CONVERT_SECONDS:
        cache_digest.save(path, lambda partial: _save(state, partial))  # a cache it cannot write: one warning
    return state


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    try:
        torch.save(state, path)
    except RuntimeError as e:  # a state in memory fails to save only for the disk's reasons ("unexpected pos")
        raise cache_digest.io_error(e) from e


def _cache_file(gguf: GGUFFile, dtype: str, layout: str) -> Path:
    from verispec.checkpoints import cache_dir

    return cache_dir("weights") / f"{Path(gguf.path).stem}-{dtype}-{content_key(gguf, layout)}.pt"


def content_key(gguf: GGUFFile, layout: str = "", num_samples: int = 16, sample_bytes: int = 4096) -> str:
    """sha256 (16 hex digits) over the header (metadata, tensor table), the file's size and
    mtime, and `num_samples` evenly spaced windows of its tensor data."""
    stat = os.stat(gguf.path)
    table = [(t.name, t.shape, int(t.ggml_type), t.offset) for t in map(gguf.tensor_info, gguf)]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, layout, stat.st_size, stat.st_mtime_ns,
                                        gguf.metadata_digest(), table]).encode())
    span = max(stat.st_size - gguf.data_offset - sample_bytes, 0)
    with open(gguf.path, "rb") as f:
        for k in range(num_samples):
            f.seek(gguf.data_offset + span * k // (num_samples - 1))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]
