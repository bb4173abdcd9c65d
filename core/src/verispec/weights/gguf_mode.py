"""The `gguf` weight mode's choice of linear class per GGUF tensor: the file's ggml type
decides (weights.gguf_blocks.BLOCK_FORMATS types run as stored in weights.block_linear's classes, the rest
are requantised to int8), and a stacked linear whose parts differ runs partwise.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gguf.constants import GGMLQuantizationType
from torch import nn

from verispec.errors import VerispecError
from verispec.kernels import ckernels
from verispec.weights.block_linear import block_linear_class
from verispec.weights.gguf_blocks import BLOCK_FORMATS
from verispec.weights.quant import Float32Linear, GGUFLinear, Int8Linear, PartwiseLinear, replace_linears

__all__ = ["GGUF_REQUANTISED", "UnmappedGGUFType", "default_dtype", "gguf_linear_class", "resolve_gguf_linears"]


def default_dtype(preferred: str = "gguf") -> str:
    """A family's default weight dtype: `preferred` (the gemma and llama families: "gguf"), except
    "gguf" becomes "int8" where the C kernels are not built. Without them the gguf mode runs its
    kernel's arithmetic in PyTorch (the linears' bits for a given input, ~20x slower: Gemma 3 270M 2.8 tok/s, measured
    2026-12-02), so the default falls back to torch's int8 kernel; the kernels' one warning says
    why they are missing. An explicit dtype is never changed."""
    return "int8" if preferred == "gguf" and ckernels.library() is None else preferred


#: the ggml types a `--dtype gguf` linear takes as per-output-channel int8 (requantised from
#: gguf-py's dequantisation: not exact), the block kernel having no format for them: every other
#: type gguf-py dequantises (names absent from an older gguf are skipped).
GGUF_REQUANTISED = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q2_K", "Q3_K", "IQ1_S", "IQ1_M",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
    "NVFP4") if name in GGMLQuantizationType.__members__)


class UnmappedGGUFType(VerispecError, ValueError):
    """`--dtype gguf` met a tensor whose ggml type it has no mapping for."""

    def __init__(self, name: str, ggml_type: GGMLQuantizationType):
        self.name, self.ggml_type = name, ggml_type
        exact = ", ".join(t.name for t in BLOCK_FORMATS)
        wider = ", ".join(sorted(t.name for t in GGUF_REQUANTISED))
        super().__init__(f"{name} is stored as {ggml_type.name}, which the gguf weight mode has no mapping "
                         f"for (it runs {exact} as stored and requantises {wider} to int8); re-quantise the file "
                         "to one of those types (llama.cpp's llama-quantize)")


def gguf_linear_class(name: str, ggml_type: GGMLQuantizationType) -> type[Float32Linear]:
    """The `gguf` mode's class for GGUF tensor `name` stored as `ggml_type`: the type's
    weights.block_linear class for a type in weights.gguf_blocks.BLOCK_FORMATS (the file's values as
    stored), else Int8Linear (not exact: requantised per output channel). Raises
    UnmappedGGUFType naming the tensor for a type in neither set."""
    if ggml_type in BLOCK_FORMATS:
        return block_linear_class(ggml_type)
    if ggml_type in GGUF_REQUANTISED:
        return Int8Linear
    raise UnmappedGGUFType(name, ggml_type)


def resolve_gguf_linears(model: nn.Module,
                         part_types: Callable[[str], Mapping[str, GGMLQuantizationType]],
                         part_rows: Callable[[str], Sequence[int] | None] = lambda prefix: None) -> nn.Module:
    """Replace every GGUFLinear placeholder in `model` (meta) by an empty module for the ggml
    types of its source parts, `part_types(prefix)` (`prefix` its module name, parts in stack
    order); in place. Each part's class is `gguf_linear_class(part, type)`; when every part
    has the same class the linear is one module of it (parts of one block type: one block
    linear of their stacked values; float parts: one int8 linear, requantised per output row as
    the parts would be alone). Parts of different classes (a Q4_K_M file's Q4_K attn_q/attn_k
    beside a Q6_K attn_v) make the placeholder a `PartwiseLinear` of one linear per run of parts
    of one class, each as stored. The parts' rows are `part_rows(prefix)` (the owning module's
    declaration), else equal shares.
    Raises UnmappedGGUFType, ValueError when declared rows do not fit the parts."""
    def choose(prefix: str, old: nn.Module) -> nn.Module:
        if not isinstance(old, GGUFLinear):
            return old
        types = part_types(prefix)
        classes = [gguf_linear_class(name, t) for name, t in types.items()]
        if len(set(classes)) <= 1:  # no parts (an absent optional source): as for a float tensor
            return (classes[0] if classes else Int8Linear)(old.in_features, old.out_features, device="meta")
        rows = tuple(part_rows(prefix) or [old.out_features // len(classes)] * len(classes))
        if len(rows) != len(classes) or sum(rows) != old.out_features:
            raise ValueError(f"{prefix}: {len(classes)} stacked parts cannot have rows {rows} "
                             f"of its {old.out_features}")
        runs: list[tuple[type[Float32Linear], list[int]]] = []
        for cls, r in zip(classes, rows):
            if runs and runs[-1][0] is cls:
                runs[-1][1].append(r)
            else:
                runs.append((cls, [r]))
        return PartwiseLinear([cls(old.in_features, sum(r), device="meta") for cls, r in runs],
                              {str(j): tuple(r) for j, (_, r) in enumerate(runs) if len(r) > 1})

    return replace_linears(model, choose)
