"""Checks for the `gguf` weight mode (against gguf-py's own dequantisation of a file's blocks,
and its batch invariance on a real trunk), shared by core's tests and each model package's
real-checkpoint tests."""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from gguf.quants import dequantize

from verispec.gguf_io import GGUFFile
from verispec.nn.gguf_blocks import GROUP, INT4_TYPES, GGUFBlocks, unpack_int4
from verispec.nn.quant import GGUFInt4Linear

__all__ = ["BF16_UNIT_ROUNDOFF", "assert_file_int4_tensors_exact", "assert_verify_rows_are_one_row_decodes",
           "assert_within_scale_rounding"]

#: |bf16(x) - x| <= 2^-8 |x| (8 significant bits, round to nearest).
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def _expand(groups: torch.Tensor) -> torch.Tensor:
    return groups.repeat_interleave(GROUP, dim=1)


def assert_within_scale_rounding(weights: torch.Tensor, parts: Sequence[GGUFBlocks]) -> None:
    """weights fp32 [rows, cols] are `gguf.quants.dequantize` of `parts` (stacked along rows)
    within 2^-8 · (|q - 8| · |scale| + |zero|) + one fp32 rounding per element: the bf16
    rounding of each group's scale and zero, nothing else."""
    expected = torch.cat([torch.from_numpy(dequantize(p.data.numpy(), p.ggml_type)) for p in parts])
    q, scale, zero = (torch.cat(t) for t in zip(*map(unpack_int4, parts)))
    bound = (BF16_UNIT_ROUNDOFF * ((q.float() - 8).abs() * _expand(scale).abs() + _expand(zero).abs())
             + torch.finfo(torch.float32).eps * expected.abs())
    excess = (weights - expected).abs() - bound
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} weights beyond the bound, worst by {excess.max():.3g}"


def assert_file_int4_tensors_exact(path: str | os.PathLike) -> int:
    """For every Q4_0/Q4_1/Q4_K tensor of the GGUF at `path`: the unpacked fp32 groups
    (q - 8) · scale + zero equal gguf-py's dequantisation bitwise, and a GGUFInt4Linear built
    from the blocks dequantises within `assert_within_scale_rounding`. Returns how many
    tensors were checked."""
    gguf = GGUFFile.open(path)
    checked = 0
    for name in gguf:
        raw, ggml_type, shape = gguf.raw_tensor(name)
        if ggml_type not in INT4_TYPES:
            continue
        blocks = GGUFBlocks(ggml_type, torch.from_numpy(np.array(raw)), shape[-1])
        q, scale, zero = unpack_int4(blocks)
        unpacked = (q.float() - 8) * _expand(scale) + _expand(zero)
        assert torch.equal(unpacked, torch.from_numpy(dequantize(np.array(raw), ggml_type))), name
        assert_within_scale_rounding(GGUFInt4Linear.from_gguf([blocks]).rows(torch.arange(shape[0])), [blocks])
        checked += 1
    return checked


def assert_verify_rows_are_one_row_decodes(target, tokens: Sequence[int], prefix: int, max_rows: int = 9) -> None:
    """After `prefix` tokens, a k-row verify of the next k tokens (k = 2..max_rows) gives logits
    bitwise equal to one-row decodes of the same tokens: the batch invariance a `gguf`-mode
    trunk declares, on a real file's mixed int4 / int8 linears."""
    from verispec.testing import forward_one

    assert len(tokens) >= prefix + max_rows, "too few tokens for the prefix and the widest verify"
    seq = target.new_sequence()
    forward_one(target, seq, tokens[:prefix], logits="last")
    alone = torch.cat([forward_one(target, seq, tokens[i:i + 1]).logits for i in range(prefix, prefix + max_rows)])
    target.truncate(seq, prefix)
    for k in range(2, max_rows + 1):
        rows = forward_one(target, seq, tokens[prefix:prefix + k], verify=True).logits
        assert torch.equal(rows, alone[:k]), f"k={k}: max |diff| {(rows - alone[:k]).abs().max():.3g}"
        target.keep(seq, 0)
    target.release(seq)
