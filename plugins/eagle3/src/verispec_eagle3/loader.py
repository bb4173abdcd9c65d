"""The `DraftFileSpec` loader: an `eagle3` GGUF (llama.cpp b11434's format) bound to
its trunk as an `Eagle3Head`.

What the file means, read from llama.cpp's sources (src/models/eagle3.cpp, src/models/llama.cpp,
src/llama-arch.cpp, conversion/llama.py; the commits read are named in the package README):

- Taps: `eagle3.target_layers` id L is the residual ENTERING 0-based trunk layer L (llama.cpp's
  llama graph calls `cb(inpL, "eagle3_extract_i", il)` before layer il's attention norm; HF EAGLE-3
  and vLLM collect the same input of layer L). That is verispec's `Segment.tap_layers` numbering as
  is: no +1 (unlike DFlash's file, whose converter adds 1 to HF's output-of-layer ids). The
  converter writes [2, L//2, L-3] for an L-layer target. fc reads the three rows concatenated in
  the file's order.
- Residual: the attention output is added to the RAW fused feature g (the decoder's input row),
  or to its hidden-normed form gn when `eagle3.norm_before_residual` is true (RedHat speculators'
  checkpoints); the FFN residual is then the usual one.
- `eagle3.norm_before_fc` (default false): one RMSNorm over the 3·Dt concatenated taps before fc,
  weight `enc.output_norm.weight` [3·Dt] (speculators' `input_norm`, gpt-oss-style heads). The
  llama.cpp eagle3.cpp revisions read here do not read this key; the tensor name follows the
  converters that write it. A file with it false is the mainline graph exactly.
- `d2t`: I64 [Vd], ABSOLUTE target ids (the converter adds arange to HF's offsets and refuses
  out-of-range or duplicated ids; so do we, at binding). Without `output` the trunk's LM head is
  read, without `token_embd` the trunk's embedding rows (llama/qwen2: the raw table).
- RoPE: LLAMA_ROPE_TYPE_NORM (adjacent pairs) on the file's permuted q/k rows, `rope_freqs`
  divisors when present.

Steps: keys and shapes (`config.Eagle3Config.from_gguf`), finite numbers and sizes
(`gguf.checks.check_numbers`), d2t read as int64, the binding (`binding.binding_problem`, raised as
seams.DrafterMismatch), then every tensor as fp32 (gguf-py dequantises a quantised file; a NaN or
an infinity in any is refused, `check_drafter_values`) and the linears converted to the trunk's
weight dtype (`head_dtype`).
"""
from __future__ import annotations

import os

import torch
from verispec.errors import UnsupportedArchitecture
from verispec.gguf.checks import check_drafter_values, check_numbers
from verispec.gguf.io import GGUFFile
from verispec.seams import DrafterMismatch

from verispec_eagle3.binding import binding_problem
from verispec_eagle3.config import ARCH, D2T, ROPE_FREQS, TOKEN_EMBD, Eagle3Config, UnsupportedEagle3
from verispec_eagle3.head import Eagle3Head
from verispec_eagle3.modeling import Eagle3Layer

__all__ = ["load", "read_config"]


def read_config(path: str | os.PathLike) -> tuple[GGUFFile, Eagle3Config]:
    """(the opened GGUF, its Eagle3Config). Raises errors.UnsupportedArchitecture (not `eagle3`) and
    what Eagle3Config.from_gguf raises."""
    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    if gguf.architecture != ARCH:
        raise UnsupportedArchitecture(path, gguf.architecture, (ARCH,))
    return gguf, Eagle3Config.from_gguf(gguf.metadata, {n: gguf.tensor_info(n).shape for n in gguf}, source=path)


def load(path: str | os.PathLike, trunk) -> Eagle3Head:
    """The head in `path` as the PER_TOKEN draft head of `trunk`.

    Raises seams.DrafterMismatch (a VerispecError naming the mismatch and the fix: trunk family,
    target hidden size, layer ids past the trunk's depth, widths, vocabulary, d2t out of range or
    duplicated, tokenizer), config.UnsupportedEagle3 (a d2t that is not I64), errors.UnsupportedArchitecture,
    errors.UnusedTensors, gguf errors (MissingKey, MissingTensor), errors.DamagedFile (non-finite
    numbers in the keys, or a tensor holding a NaN or an infinity: the file and the tensor are named)."""
    path = os.fspath(path)
    gguf, config = read_config(path)
    check_numbers(gguf)
    d2t = None
    if D2T in gguf:
        d2t = gguf.tensor(D2T)
        if d2t.dtype != torch.int64:
            raise UnsupportedEagle3(path, f"d2t is stored as {gguf.tensor_info(D2T).ggml_type.name}",
                                    "llama.cpp reads it as I64 absolute target ids: convert the head again")
        d2t = d2t.reshape(-1)
    problem = binding_problem(config, d2t, gguf.get("tokenizer.ggml.tokens"), trunk)
    if problem is not None:
        made_for = gguf.metadata.get("general.name")
        raise DrafterMismatch(f"--draft-model {path}{f' ({made_for})' if made_for else ''} does not fit this "
                              f"model: {problem}")
    w = {name: gguf.tensor(name) for name in config.expected_shapes()}
    factors = gguf.tensor(ROPE_FREQS) if ROPE_FREQS in gguf else None
    for name, values in (w | ({ROPE_FREQS: factors} if factors is not None else {})).items():
        check_drafter_values(path, name, values)
    layer = Eagle3Layer(config, w, rope_factors=factors, dtype=head_dtype(getattr(trunk, "dtype", "float32")))
    return Eagle3Head(layer, trunk.view(), vocab_size=trunk.vocab_size, embedding=w.get(TOKEN_EMBD), d2t=d2t,
                      path=path)


def head_dtype(trunk_dtype: str) -> str:
    """The head's linears take the trunk's weight dtype (a head step reads its weights once: bytes are
    its cost), except int4, whose groups the head's widths need not fill: int8 then. The `gguf` mode
    builds float-read linears as int8 (quant.GGUFLinear)."""
    return "int8" if trunk_dtype == "int4" else trunk_dtype
