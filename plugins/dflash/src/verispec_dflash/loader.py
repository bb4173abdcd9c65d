"""The `DraftFileSpec` loader: a `dflash` GGUF (DFlash or DFlash2) bound to its trunk as a `DFlashHead`.

Steps: read the keys and tensor shapes (`config.DFlashConfig.from_gguf`: schema, generation,
every tensor present with its shape, nothing unknown), check the numbers are finite
(`gguf_checks.check_numbers`), check the binding against the trunk (`binding.binding_problem`),
then dequantise every tensor to fp32 (a drafter is small next to its target; quantised files
load too, as gguf-py dequantises them).
"""
from __future__ import annotations

import os

from verispec.errors import UnsupportedArchitecture
from verispec.gguf_checks import check_numbers
from verispec.gguf_io import GGUFFile
from verispec.seams import DrafterMismatch

from verispec_dflash.binding import binding_problem
from verispec_dflash.config import ARCH, DFlashConfig
from verispec_dflash.drafter import DFlashDrafter
from verispec_dflash.head import DFlashHead

__all__ = ["load", "read_config"]


def read_config(path: str | os.PathLike) -> tuple[GGUFFile, DFlashConfig]:
    """(the opened GGUF, its DFlashConfig). Raises errors.UnsupportedArchitecture (not `dflash`),
    and what DFlashConfig.from_gguf raises."""
    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    if gguf.architecture != ARCH:
        raise UnsupportedArchitecture(path, gguf.architecture, (ARCH,))
    return gguf, DFlashConfig.from_gguf(gguf.metadata, {n: gguf.tensor_info(n).shape for n in gguf}, source=path)


def load(path: str | os.PathLike, trunk, *, use_conv: bool = True, use_selector: bool = True) -> DFlashHead:
    """The drafter in `path` as the BLOCK draft head of `trunk`.

    use_conv / use_selector: DFlash2 attribution switches (drafter.DFlashDrafter); not a way to run a model.
    Raises seams.DrafterMismatch (a VerispecError naming the mismatch and the fix: hidden size, taps
    vs the trunk's depth, fc width vs tap count, tokenizer, mask id, selector vocabulary),
    errors.NotADFlashDrafter / UnsupportedDFlash / MalformedDFlash, errors.UnsupportedArchitecture,
    gguf_io errors (MissingKey, ...), errors.DamagedFile (non-finite numbers).
    """
    path = os.fspath(path)
    gguf, config = read_config(path)
    check_numbers(gguf)
    tokens = gguf.get("tokenizer.ggml.tokens")
    problem = binding_problem(config, tokens, trunk)
    if problem is not None:
        raise DrafterMismatch(f"--draft-model {path}: {problem}")
    tensors = {name: gguf.tensor(name) for name in config.expected_shapes()}
    drafter = DFlashDrafter(config, tensors, use_conv=use_conv, use_selector=use_selector)
    return DFlashHead(drafter, trunk.view(), max_context=trunk.max_context_length, path=path)
