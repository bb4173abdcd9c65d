"""Checks for the `gguf` weight mode (against gguf-py's own dequantisation of a file's blocks,
and its batch invariance on a real trunk), shared by core's tests and each model package's
real-checkpoint tests."""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from verispec.gguf.io import GGUFFile
from verispec.weights.block_linear import block_linear_class
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack

__all__ = ["assert_file_block_tensors_exact", "assert_fused_layers_are_op_by_op",
           "assert_verify_rows_are_one_row_decodes", "random_blocks"]


#: byte offsets of each type's fp16 fields (d, m, dmin) within a block
F16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
              T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random stored blocks, every fp16 field (d, m, dmin) a finite
    value of either sign around 1e-3 (a real checkpoint's range), every other byte random."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        f16 = (rng.standard_normal((rows, cols // block_size, 1)) * 1e-3).astype(np.float16)
        raw[..., offset:offset + 2] = f16.view(np.uint8)
    return raw.reshape(rows, -1)


def assert_file_block_tensors_exact(path: str | os.PathLike) -> dict[str, int]:
    """For every 2-D tensor of the GGUF at `path` stored in a block-kernel type (weights.gguf_blocks
    BLOCK_FORMATS): the unpacked values, and the rows of the block linear built from them,
    equal gguf-py's dequantisation bitwise. Returns how many tensors of each type were checked."""
    gguf = GGUFFile.open(path)
    checked: dict[str, int] = {}
    for name in gguf:
        raw, ggml_type, shape = gguf.raw_tensor(name)
        if ggml_type not in BLOCK_FORMATS or len(shape) != 2:
            continue
        blocks = GGUFBlocks.from_raw(raw, ggml_type, shape)
        expected = torch.from_numpy(dequantize(np.array(raw), ggml_type))
        assert torch.equal(unpack(blocks).dequantize(), expected), name
        linear = block_linear_class(ggml_type).from_gguf([blocks])
        assert torch.equal(linear.rows(torch.arange(shape[0])), expected), name
        checked[ggml_type.name] = checked.get(ggml_type.name, 0) + 1
    return checked


def assert_verify_rows_are_one_row_decodes(trunk, tokens: Sequence[int], prefix: int, max_rows: int = 9) -> None:
    """After `prefix` tokens, a k-row verify of the next k tokens (k = 2..max_rows) gives logits
    bitwise equal to one-row decodes of the same tokens: the batch invariance a `gguf`-mode
    trunk declares, on a real file's block linears of several types. Each run is a fork of the
    prefilled prefix, so recurrent (hybrid) trunks, which cannot truncate, are checked too."""
    from verispec.testing import forward_one

    assert len(tokens) >= prefix + max_rows, "too few tokens for the prefix and the widest verify"
    base = trunk.new_sequence()
    forward_one(trunk, base, tokens[:prefix], logits="last")
    seq = trunk.fork(base, prefix)
    alone = torch.cat([forward_one(trunk, seq, tokens[i:i + 1]).logits for i in range(prefix, prefix + max_rows)])
    trunk.release(seq)
    for k in range(2, max_rows + 1):
        seq = trunk.fork(base, prefix)
        rows = forward_one(trunk, seq, tokens[prefix:prefix + k], verify=True).logits
        assert torch.equal(rows, alone[:k]), f"k={k}: max |diff| {(rows - alone[:k]).abs().max():.3g}"
        trunk.release(seq)
    trunk.release(base)


def assert_fused_layers_are_op_by_op(trunk, tokens: Sequence[int], prefill: int) -> None:
    """A family whose layers can run as one C call each (`fused`, nn.layers) gives the op-by-op
    forward's logits bitwise: a `prefill`-token prefill (chunked when longer than the chunk),
    three one-row decodes and a 7-row verify, fused then op by op; the fused kernel must have run
    once per layer per forward, and not at all when switched off."""
    from verispec.nn.layers import DecoderLayerKernel
    from verispec.testing import forward_one

    assert len(tokens) >= prefill + 10, "too few tokens for the prefill, decodes and verify"
    calls = []
    original = DecoderLayerKernel.run

    def counted(kernels, *args):
        calls.extend(kernels)
        return original(kernels, *args)

    def run(fused: bool) -> list[torch.Tensor]:
        for layer in trunk.model.layers:
            layer.fused = fused
        seq = trunk.new_sequence()
        out = [forward_one(trunk, seq, tokens[:prefill], logits="all").logits]
        out += [forward_one(trunk, seq, tokens[prefill + i:prefill + i + 1]).logits for i in range(3)]
        out.append(forward_one(trunk, seq, tokens[prefill + 3:prefill + 10], verify=True).logits)
        trunk.release(seq)
        return out

    DecoderLayerKernel.run = staticmethod(counted)
    try:
        fused = run(True)
        assert len(calls) >= 5 * len(trunk.model.layers), "the fused layers did not run"
        count = len(calls)
        plain = run(False)
        assert len(calls) == count, "switched off, the fused layers still ran"
    finally:
        DecoderLayerKernel.run = staticmethod(original)
        for layer in trunk.model.layers:
            layer.fused = True
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"forward {i}: max |diff| {(a - b).abs().max():.3g}"
