"""A GGUF's vocabulary as a `tokenizers.Tokenizer`: built from its `tokenizer.ggml.*` keys, cached.

`load_backend` feeds our parsed metadata to transformers' GGUF converter
(`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`) instead of its own
reader, and saves the result as tokenizer.json under `cache_dir("tokenizers")`, keyed by a hash of
the raw `tokenizer.ggml.*` metadata bytes, the architecture and the transformers version, so only the
first start imports transformers. The entry's sha256 is saved beside it and checked first
(`cache_digest`): an entry that differs, even as valid JSON, or is not a file, is rebuilt; a cache
that cannot be written costs one warning and the backend is used uncached. Metadata that builds no
tokenizer raises UnbuildableVocabulary, which `verispec.tokenizer` reports as UnsupportedTokenizer.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from verispec import cache_digest
from verispec.errors import pip_install
from verispec.gguf.io import GGUFFile

# bump when the way the backend is built changes: old cache entries are then ignored
_BUILD_VERSION = 1


class UnbuildableVocabulary(Exception):
    """The file's tokenizer metadata builds no tokenizer; `reason` says why and what to do."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def load_backend(gguf: GGUFFile, model: str, use_cache: bool):
    """The `tokenizers.Tokenizer` of the file's `tokenizer.ggml.*` metadata (`model`: its
    tokenizer.ggml.model), from the cache when an intact entry is there, else built and saved.
    Raises UnbuildableVocabulary."""
    from tokenizers import Tokenizer as Backend

    path = None
    if use_cache:
        from verispec.checkpoints import cache_dir

        path = cache_dir("tokenizers") / f"{_cache_key(gguf)}.json"
        if cache_digest.intact(path, "tokenizer"):
            try:
                return Backend.from_file(str(path))
            except Exception as e:  # noqa: BLE001 -- tokenizers raises bare Exception; a damaged entry is rebuilt
                cache_digest.discard(path, "tokenizer", f"does not load ({type(e).__name__})")
    backend = _build(gguf, model)
    if path is not None:
        cache_digest.save(path, lambda partial: _save(backend, partial))  # a cache it cannot write: one warning
    return backend


def _save(backend, path) -> None:
    try:
        backend.save(str(path))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for an I/O error
        raise cache_digest.io_error(e) from e


def _cache_key(gguf: GGUFFile) -> str:
    import hashlib

    from importlib_metadata import PackageNotFoundError, version

    try:
        converter = version("transformers")
    except PackageNotFoundError:
        converter = "none"
    head = json.dumps([_BUILD_VERSION, gguf.architecture, converter, gguf.metadata_digest("tokenizer.ggml.")])
    return hashlib.sha256(head.encode()).hexdigest()[:32]


def _build(gguf: GGUFFile, model: str):
    """A `tokenizers.Tokenizer` from the file's tokenizer metadata, via transformers' converter."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:
        raise UnbuildableVocabulary(f"building it the first time needs transformers ({e}); "
                                   + pip_install("'transformers>=5.23'")) from None
    md = gguf.metadata
    spec = {name: md[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in md}
    for name in ("scores", "token_type"):  # the converter zips and compares them as Python values
        if name in spec:
            spec[name] = spec[name].tolist()
    if model == "gpt2" and "tokenizer.ggml.merges" not in md:
        raise UnbuildableVocabulary("the file has no tokenizer.ggml.merges, which a "
                                   "byte-level BPE vocabulary needs; reconvert the model with its merges")
    try:
        backend, _ = convert_gguf_tokenizer(gguf.architecture, spec)
    except ValueError as e:
        raise UnbuildableVocabulary(str(e)) from None
    except Exception as e:  # noqa: BLE001 -- the converter and tokenizers fail on bad metadata in many ways
        # (a KeyError for a missing key, the Rust side's bare Exception for a merge naming an absent token)
        lines = str(e).strip().splitlines()
        raise UnbuildableVocabulary(f"its tokenizer.ggml metadata does not build "
                                   f"({type(e).__name__}: {lines[0] if lines else 'no message'}); reconvert "
                                   "the model") from None
    _set_unknown_token(backend, md)
    return backend


def _set_unknown_token(backend, md: Mapping[str, Any]) -> None:
    """Byte-level BPE gets no unknown token from the converter, so a byte missing from the
    vocabulary would vanish silently. Real vocabularies hold all 256 bytes and never reach
    this; trimmed fixture vocabularies (verispec.testing.fixture_writer) map it to <unk>."""
    from tokenizers.models import BPE

    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    if isinstance(backend.model, BPE) and backend.model.unk_token is None and unk_id is not None:
        backend.model.unk_token = md["tokenizer.ggml.tokens"][unk_id]
