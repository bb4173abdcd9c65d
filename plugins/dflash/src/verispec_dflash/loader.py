"""The `DraftFileSpec` loader: a `dflash` GGUF (DFlash or DFlash2) bound to its trunk as a `DFlashHead`.

Steps: check the numbers (`verispec.gguf.checks.check_numbers`: block_count backed by the file's
blocks, sizes no larger than its tensors, finite floats) before anything is sized by them, read the
keys and tensor shapes (`config.DFlashConfig.from_gguf`: schema, generation, every tensor present
with its shape, nothing unknown), check the binding against the trunk (`binding.binding_problem`),
then read every tensor as fp32 (gguf-py's dequantisation; a NaN or an infinity in any is refused,
`check_drafter_values`) and, for the linears of a quantised
file (fc, q/k/v/o, gate/up/down in a type the core's block kernel reads), the file's own blocks
as `BlockLinear`s: a drafter forward is bound by the bytes of its weights, and Q8_0 blocks are a
quarter of fp32's. `block_kernel=False` multiplies by the fp32 tensors instead.
"""
from __future__ import annotations

import os

from verispec.errors import UnsupportedArchitecture
from verispec.gguf.checks import check_drafter_values, check_numbers
from verispec.gguf.io import GGUFFile
from verispec.seams import DrafterMismatch
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks

from verispec_dflash.binding import binding_problem
from verispec_dflash.config import ARCH, DFlashConfig
from verispec_dflash.drafter import DFlashDrafter
from verispec_dflash.head import DFlashHead

__all__ = ["load", "read_config"]


def read_config(path: str | os.PathLike) -> tuple[GGUFFile, DFlashConfig]:
    """(the opened GGUF, its DFlashConfig). Raises errors.UnsupportedArchitecture (not `dflash`),
    errors.DamagedFile (numbers the file does not back: check_numbers, before the config sizes a
    per-layer tuple by block_count), and what DFlashConfig.from_gguf raises."""
    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    if gguf.architecture != ARCH:
        raise UnsupportedArchitecture(path, gguf.architecture, (ARCH,))
    check_numbers(gguf)
    return gguf, DFlashConfig.from_gguf(gguf.metadata, {n: gguf.tensor_info(n).shape for n in gguf}, source=path)


#: the 2-D weights the drafter multiplies activations by (a layer's, after "blk.N.")
LINEARS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
           "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def load(path: str | os.PathLike, trunk, *, use_conv: bool = True, use_selector: bool = True,
         block_kernel: bool = True) -> DFlashHead:
    """The drafter in `path` as the BLOCK draft head of `trunk`.

    use_conv / use_selector: DFlash2 attribution switches (drafter.DFlashDrafter); not a way to run a model.
    Raises seams.DrafterMismatch (a VerispecError naming the mismatch and the fix: hidden size, taps
    vs the trunk's depth, fc width vs tap count, tokenizer, mask id, selector vocabulary),
    errors.NotADFlashDrafter / UnsupportedDFlash / MalformedDFlash, errors.UnsupportedArchitecture,
    verispec.gguf.errors (MissingKey, ...), errors.DamagedFile (non-finite numbers in the keys, or a
    tensor holding a NaN or an infinity: the file and the tensor are named).
    """
    path = os.fspath(path)
    gguf, config = read_config(path)
    tokens = gguf.get("tokenizer.ggml.tokens")
    problem = binding_problem(config, tokens, trunk)
    if problem is not None:
        made_for = gguf.metadata.get("general.name")
        raise DrafterMismatch(f"--draft-model {path}{f' ({made_for})' if made_for else ''} does not fit this "
                              f"model: {problem}")
    tensors = {name: gguf.tensor(name) for name in config.expected_shapes()}
    for name, values in tensors.items():
        check_drafter_values(path, name, values)
    linears = block_linears(gguf, tensors) if block_kernel else {}
    drafter = DFlashDrafter(config, tensors, linears=linears, use_conv=use_conv, use_selector=use_selector)
    return DFlashHead(drafter, trunk.view(), max_context=trunk.max_context_length, path=path)


def block_linears(gguf: GGUFFile, tensors) -> dict:
    """GGUF name -> BlockLinear over the stored blocks, for each linear weight whose type the block
    kernel reads and whose input width is a multiple of 32 (F32/F16 weights are left out)."""
    from verispec.weights.block_linear import block_linear_class

    out = {}
    for name in tensors:
        if not (name == "fc.weight" or name.split(".", 2)[-1] in LINEARS):
            continue
        raw, ggml_type, shape = gguf.raw_tensor(name)
        if ggml_type not in BLOCK_FORMATS or shape[-1] % 32:
            continue
        out[name] = block_linear_class(ggml_type).from_gguf([GGUFBlocks.from_raw(raw, ggml_type, shape)])
    return out
