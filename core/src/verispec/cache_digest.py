"""A cache entry's sha256, saved beside it: an entry that does not match is a miss, never read.

A converted state dict with 4 KiB scrambled inside a tensor, or a tokenizer.json with one
vocabulary piece changed, still parses, so the reader cannot tell it from the file that was
written; its digest can. `save(path, write)` writes an entry through a `.partial` file and
puts `<entry>.sha256` beside it; `intact(path, what)` is the reader's check. An entry whose
digest is missing or differs is deleted with one logged warning ("... rebuilding it"), and the
caller rebuilds it as it would any miss; so is an entry that is not a file (a directory in its
place), which would otherwise fail every write.

A cache that cannot be written (read-only, full, a path under a file) is never fatal: `save`
returns False and the run goes on with what it built in memory, after one warning per process
(`unwritable`) naming the folder and the fix.

Cost: one sha256 pass over the entry per load (hashlib with the CPU's SHA extensions:
~1.6 GB/s, 0.16 s for the Gemma 3 270M's 253 MB converted state; blake2b is ~0.95 GB/s).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
_CHUNK_BYTES = 1 << 20


def digest_path(path: Path) -> Path:
    """Where the sha256 (64 hex digits, no newline) of the entry at `path` is kept."""
    return path.with_name(path.name + ".sha256")


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of the file at `path`, read in 1 MiB chunks (as fast as
    hashlib.file_digest, which needs Python 3.11; verispec supports 3.10). Raises OSError."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def save(path: Path, write: Callable[[Path], object]) -> bool:
    """Write the entry at `path`: `write(partial)` fills `<path>.<pid>.partial`, whose sha256
    is put beside `path` before the entry is renamed into place, so a reader never sees a
    whole entry without its digest, and a crash in between leaves a digest without an entry (a
    miss). Returns True once it is in place; False when the cache cannot be written (an OSError
    on the way: read-only, full; see `unwritable`). Anything else `write` raises propagates.
    Either way its partial files are removed."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    digest = digest_path(path)
    digest_partial = digest.with_name(f"{digest.name}.{os.getpid()}.partial")
    try:
        for taken in (path, digest):  # a directory (or anything not a file) in the entry's place
            if taken.exists() and not taken.is_file():
                remove(taken)
        write(partial)
        digest_partial.write_text(file_sha256(partial))
        os.replace(digest_partial, digest)
        os.replace(partial, path)
        return True
    except OSError as e:
        unwritable(path.parent, e)
        return False
    finally:
        for leftover in (partial, digest_partial):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:  # a read-only folder: nothing was written there either
                pass


_warned: list[Path] = []


def unwritable(folder: Path, error: BaseException) -> None:
    """Log, once per process, that the cache at `folder` cannot be written and the run goes on
    uncached: "verispec: the cache at <folder> cannot be written (<why>); this run goes on
    without caching ...; point VERISPEC_CACHE at a writable folder"."""
    if _warned:
        return
    _warned.append(folder)
    why = getattr(error, "strerror", None) or str(error) or type(error).__name__
    log.warning("verispec: the cache at %s cannot be written (%s); this run goes on without caching (converted "
                "weights, tokenizers and C kernels are rebuilt each run): point VERISPEC_CACHE at a writable "
                "folder with free space", folder, why)


def io_error(error: BaseException) -> OSError:
    """The OSError a writer raises for a failure that can only be the disk's (torch.save of a
    state in memory into a full disk raises RuntimeError "... unexpected pos ..."; tokenizers'
    save a bare Exception), so that `save` treats it as an unwritable cache."""
    lines = str(error).strip().splitlines()
    return OSError(errno.EIO, f"{type(error).__name__}: {lines[0] if lines else 'write failed'}")


def remove(path: Path) -> None:
    """Delete a cache entry that is a file, a link or a directory; gone already is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def intact(path: Path, what: str) -> bool:
    """Whether the entry at `path` is the file `save` wrote: False when there is none; when its
    sha256 differs from the one beside it, or none is there, the entry is discarded (see
    `discard`; `what` names it, e.g. "converted weights") and False returned."""
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a directory in its place: healed, rebuilt by the caller
            discard(path, what, "is not a file")
        return False
    try:
        saved = digest_path(path).read_text()
    except OSError:
        discard(path, what, "has no sha256 saved beside it")
        return False
    try:
        if file_sha256(path) == saved:
            return True
    except OSError:  # another run discarded it meanwhile
        return False
    discard(path, what, "does not match the sha256 saved beside it")
    return False


def discard(path: Path, what: str, why: str) -> None:
    """Delete the entry at `path` and its digest, logging one warning: "verispec: cached <what>
    <path> <why>; rebuilding it". In a cache that cannot be written they stay (`unwritable`)."""
    log.warning("verispec: cached %s %s %s; rebuilding it", what, path, why)
    try:
        remove(path)
        remove(digest_path(path))
    except OSError as e:
        unwritable(path.parent, e)
