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
from verispec.nn.block_linear import block_linear_class
from verispec.nn.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack

__all__ = ["assert_file_block_tensors_exact", "assert_verify_rows_are_one_row_decodes"]


def assert_file_block_tensors_exact(path: str | os.PathLike) -> dict[str, int]:
    """For every 2-D tensor of the GGUF at `path` stored in a block-kernel type (nn.gguf_blocks
    BLOCK_FORMATS): the unpacked values, and the rows of the block linear built from them,
    equal gguf-py's dequantisation bitwise. Returns how many tensors of each type were checked."""
    gguf = GGUFFile.open(path)
    checked: dict[str, int] = {}
    for name in gguf:
        raw, ggml_type, shape = gguf.raw_tensor(name)
        if ggml_type not in BLOCK_FORMATS or len(shape) != 2:
            continue
        blocks = GGUFBlocks(ggml_type, torch.from_numpy(np.array(raw)), shape[-1])
        expected = torch.from_numpy(dequantize(np.array(raw), ggml_type))
        assert torch.equal(unpack(blocks).dequantize(), expected), name
        linear = block_linear_class(ggml_type).from_gguf([blocks])
        assert torch.equal(linear.rows(torch.arange(shape[0])), expected), name
        checked[ggml_type.name] = checked.get(ggml_type.name, 0) + 1
    return checked


def assert_verify_rows_are_one_row_decodes(target, tokens: Sequence[int], prefix: int, max_rows: int = 9) -> None:
    """After `prefix` tokens, a k-row verify of the next k tokens (k = 2..max_rows) gives logits
    bitwise equal to one-row decodes of the same tokens: the batch invariance a `gguf`-mode
    trunk declares, on a real file's block linears of several types."""
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
