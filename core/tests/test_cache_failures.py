"""Caches that cannot be written, copied caches, and entries that are not files,
and an entry without its sha256: a read-only or full VERISPEC_CACHE costs one warning
and the run goes on uncached; an assembled checkpoint in a copied cache is re-keyed by content
(hashed, never assembled again); a directory where an entry belongs is removed and rebuilt.

Root ignores a read-only folder's permissions, so "cannot be written" is made here as the
kernel would report it: a VERISPEC_CACHE under a regular file (ENOTDIR), or os.replace /
torch.save / Path.unlink raising EROFS or ENOSPC."""
import errno
import hashlib
import logging
import os
import shutil
from importlib.metadata import distribution
from pathlib import Path

import pytest
import torch

from verispec import cache_digest, checkpoints, weight_cache
from verispec.gguf import vocab
from verispec.gguf.io import GGUFFile
from verispec.specs import CheckpointSpec
from verispec.testing.fixture_writer import byte_level_vocab, write_gguf
from verispec.tokenizer import Tokenizer

TEXT = "the cat sat on the mat, twice: the cat sat on the mat"
PIECES = [("attrs", "attrs/__init__.py"), ("attrs", "attrs/converters.py")]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    monkeypatch.setattr(cache_digest, "_warned", [])  # one warning per process: each test is a fresh run
    return root


@pytest.fixture
def tok_gguf(tmp_path):
    vocab = byte_level_vocab(300)
    return write_gguf(tmp_path / "tok.gguf", arch="llama", metadata={}, vocab=vocab,
                      tensors={"token_embd.weight": torch.zeros(len(vocab["tokenizer.ggml.tokens"]), 32)})


def _cache_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == cache_digest.__name__]


def _state() -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.int8)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cached_state(path, monkeypatch, convert=_state):
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", -1.0)  # every conversion is worth caching
    return weight_cache.cached_state(GGUFFile.open(path), "fp32", convert)


# -- a cache that cannot be written ------------------------------------------------------------

def test_a_cache_under_a_file_warns_once_and_the_run_goes_on_uncached(tmp_path, monkeypatch, caplog, tok_gguf):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file")
    monkeypatch.setenv("VERISPEC_CACHE", str(blocker / "cache"))
    fresh = Tokenizer.from_gguf(tok_gguf, use_cache=False).encode(TEXT)
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == fresh
        assert _equal(_cached_state(tok_gguf, monkeypatch), _state())
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == fresh
    [line] = _cache_lines(caplog)
    assert str(blocker / "cache") in line and "cannot be written" in line and "VERISPEC_CACHE" in line
    assert blocker.read_text() == "a file"


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_or_full_cache_warns_once_and_the_run_goes_on(monkeypatch, caplog, tok_gguf, code, cache):
    real_replace = os.replace

    def refuse(src, dst, *args, **kwargs):
        if str(cache) in str(dst):
            raise OSError(code, os.strerror(code), str(dst))
        return real_replace(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", refuse)
    fresh = Tokenizer.from_gguf(tok_gguf, use_cache=False).encode(TEXT)
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == fresh
        assert _equal(_cached_state(tok_gguf, monkeypatch), _state())
    [line] = _cache_lines(caplog)
    assert os.strerror(code) in line and "goes on without caching" in line
    left = [p.name for p in cache.rglob("*") if p.is_file() and p.name != ".verispec-cache"]
    assert not [name for name in left if "partial" in name], left  # nothing half-written stays


def test_torch_save_failing_on_a_full_disk_is_an_unwritable_cache(monkeypatch, caplog, tok_gguf):
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0\nframe #0: ...")
    monkeypatch.setattr(torch, "save", full)
    with caplog.at_level(logging.WARNING):
        assert _equal(_cached_state(tok_gguf, monkeypatch), _state())
    [line] = _cache_lines(caplog)
    assert "unexpected pos" in line and "cannot be written" in line


def test_a_read_only_cache_still_serves_its_intact_entries(monkeypatch, caplog, tok_gguf, cache):
    ids = Tokenizer.from_gguf(tok_gguf).encode(TEXT)
    _cached_state(tok_gguf, monkeypatch)
    (entry,) = (cache / "tokenizers").glob("*.json")
    stale = entry.with_name(entry.name + ".999999999.partial")  # a killed run's leftover it cannot delete
    stale.write_text("half")
    monkeypatch.setattr(checkpoints, "_cleaned", set())

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(os, "replace", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(vocab, "_build", lambda *a: pytest.fail("rebuilt despite an intact entry"))
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == ids
        assert _equal(_cached_state(tok_gguf, monkeypatch, convert=lambda: pytest.fail("converted again")),
                      _state())
    assert _cache_lines(caplog) == [] and stale.exists()


# -- entries that are not files, or lack their digest ------------------------------------------

def test_a_directory_in_a_tokenizer_entrys_place_is_removed_and_rebuilt(caplog, tok_gguf, cache):
    ids = Tokenizer.from_gguf(tok_gguf).encode(TEXT)
    (entry,) = (cache / "tokenizers").glob("*.json")
    entry.unlink()
    (entry / "inside").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == ids
    assert entry.is_file() and cache_digest.intact(entry, "tokenizer")
    [line] = _cache_lines(caplog)
    assert "is not a file" in line and "rebuilding" in line
    assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == ids  # healed: the next run reads it


def test_a_directory_in_a_digests_place_is_removed_and_the_entry_rebuilt(monkeypatch, caplog, tok_gguf, cache):
    _cached_state(tok_gguf, monkeypatch)
    (entry,) = (cache / "weights").glob("*.pt")
    digest = cache_digest.digest_path(entry)
    digest.unlink()
    digest.mkdir()
    converted = []
    with caplog.at_level(logging.WARNING):
        state = _cached_state(tok_gguf, monkeypatch, convert=lambda: converted.append(1) or _state())
    assert _equal(state, _state()) and converted == [1]
    assert digest.is_file() and cache_digest.intact(entry, "converted weights")


def test_an_entry_without_its_sha256_is_not_trusted(caplog, tok_gguf, cache):
    """Its content altered as valid JSON and its digest gone: rebuilt, never read."""
    import json

    ids = Tokenizer.from_gguf(tok_gguf).encode(TEXT)
    (entry,) = (cache / "tokenizers").glob("*.json")
    saved = json.loads(entry.read_text())
    vocab = saved["model"]["vocab"]
    first, second = (next(piece for piece, i in vocab.items() if i == ids[k]) for k in (0, 1))
    vocab[first], vocab[second] = vocab[second], vocab[first]  # still loads, encodes differently
    entry.write_text(json.dumps(saved))
    cache_digest.digest_path(entry).unlink()
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tok_gguf).encode(TEXT) == ids
    [line] = _cache_lines(caplog)
    assert "has no sha256" in line and entry.name in line
    assert json.loads(entry.read_text())["model"]["vocab"][first] == ids[0]


def test_intact_refuses_an_entry_with_no_digest_and_deletes_it(tmp_path, caplog):
    entry = tmp_path / "e.bin"
    assert cache_digest.save(entry, lambda partial: partial.write_bytes(b"payload"))
    assert cache_digest.intact(entry, "test entry")
    cache_digest.digest_path(entry).unlink()
    assert not cache_digest.intact(entry, "test entry") and not entry.exists()


# -- checkpoints: a copied cache, an unwritable one ----------------------------------------------

def _bytes(pieces):
    return b"".join(Path(distribution(d).locate_file(p)).read_bytes() for d, p in pieces)


def _spec():
    data = _bytes(PIECES)
    return CheckpointSpec(alias="toy", summary="toy", pip_install="toy-weights", files=PIECES,
                          sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


@pytest.mark.parametrize("keep_mtimes", [True, False])
def test_a_copied_cache_reuses_its_assembled_checkpoint(tmp_path, monkeypatch, cache, keep_mtimes):
    first = checkpoints.assemble(_spec())
    copy = tmp_path / "elsewhere" / "cache"
    shutil.copytree(cache, copy, copy_function=shutil.copy2 if keep_mtimes else shutil.copy)
    shutil.rmtree(cache)
    monkeypatch.setenv("VERISPEC_CACHE", str(copy))
    hashed = []
    real_hash = checkpoints._hash_file
    monkeypatch.setattr(checkpoints, "_join", lambda *a: pytest.fail("assembled again in a copied cache"))
    monkeypatch.setattr(checkpoints, "_hash_file", lambda *a: hashed.append(a[0]) or real_hash(*a))
    path = checkpoints.assemble(_spec())
    assert path == copy / "checkpoints" / first.name and path.read_bytes() == _bytes(PIECES)
    assert len(hashed) == (0 if keep_mtimes else 1)  # same stamp: trusted; new mtimes: hashed once
    assert checkpoints.assemble(_spec()) == path and len(hashed) == (0 if keep_mtimes else 1)


def test_a_directory_in_the_checkpoints_place_is_removed_and_it_is_assembled(cache):
    target = checkpoints.cache_dir("checkpoints") / "toy.gguf"
    (target / "junk").mkdir(parents=True)
    path = checkpoints.assemble(_spec())
    assert path == target and path.read_bytes() == _bytes(PIECES)


def test_a_checkpoint_in_a_cache_under_a_file_is_assembled_in_a_temporary_folder(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("VERISPEC_CACHE", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING):
        path = checkpoints.assemble(_spec())
    assert path.read_bytes() == _bytes(PIECES) and str(blocker) not in str(path)
    assert len(_cache_lines(caplog)) == 1
