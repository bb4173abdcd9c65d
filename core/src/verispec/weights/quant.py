"""The weight-dtype choice, as a module swap (gpt-fast's quantize.py idea).

A model is built with plain `nn.Linear`s (HF names); `swap_linears(model, dtype)` replaces
each by the class for `dtype`, so the modeling file never branches on dtype. Every class
takes and returns fp32 activations [n, in] -> [n, out]; only the matmul sees bf16.

| dtype    | weight                         | matmul                                     | batch-invariant |
|----------|--------------------------------|--------------------------------------------|-----------------|
| float32  | fp32 [out, in]                 | F.linear fp32 (MKL gemm)                    | no: ~2e-7..5e-5 row drift |
| bfloat16 | bf16 [out, in]                 | F.linear bf16, bf16 out                     | no: CPU-dependent (AVX-512 BF16: rows differ from n = 21 at 48→80) |
| int8     | int8 [out, in] + bf16 scale [out] | aten._weight_int8pack_mm, bf16 act/out  | yes             |
| int4     | int4 groups of 32 + bf16 scale/zero | aten._weight_int4pack_mm_for_cpu, bf16 | yes (checked to 33 rows) |
| gguf     | per tensor: the file's blocks as stored (weights.gguf_blocks) | block kernel (qmatmul.c), int8 activations per 32 | yes, any row count |

gguf (the gemma, gemma4 and llama families' default) keeps the file's own quantised values: a
Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0 tensor becomes that type's
weights.block_linear.BlockLinear (nothing requantised: its rows are gguf-py's dequantisation
bitwise), whose product quantises each activation row to int8 per 32 columns as llama.cpp's
CPU kernels do; float and other types go to per-channel int8 (requantised, not exact;
GGUF_REQUANTISED), a type gguf-py cannot dequantise is refused. A stacked linear (q|k|v,
gate|up read as one) whose parts are of different types is never one requantised linear:
`resolve_gguf_linears` makes it a PartwiseLinear (one linear per run of parts of one class), so
a Q4_K q|k and a Q6_K v each run as stored. Speeds and argmax agreement with fp32 per model:
docs/benchmarks.md "Weight modes" (benchmarks/weight_modes.py). int4 requantises every tensor, head
included, to asymmetric min/max groups: it moves a quarter of Gemma's greedy choices, so it
is opt-in.

int8 is symmetric per output channel: w ≈ q · scale, q in [-127, 127], scale =
max|w_row| / 127 rounded up to bf16 (the kernel takes bf16 scales; rounding up means no
weight clips). Its output, like bf16's, is bf16-rounded (8 significant bits) before it
returns to fp32. Invariance and costs measured for this project: docs/reference/cpu-kernel-facts.md,
docs/reference/baselines.md §5.

`rows(ids)` gathers fp32 rows of the weight, so a tied embedding table and LM head are one
module (one int8 copy of Gemma's 262k x 640 table, not two).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import VerispecError

WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "int4", "gguf")
#: other spellings accepted for the same dtypes (the CLI's --dtype uses the short ones).
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "i8": "int8", "i4": "int4"}

_ROW_CHUNK = 16384  # rows quantised at a time: bounds the fp32 temporaries


class UnknownWeightDtype(VerispecError, ValueError):
    def __init__(self, dtype: object):
        self.dtype = dtype
        super().__init__(f"weight dtype {dtype!r} is not offered; choose one of {', '.join(WEIGHT_DTYPES)} "
                         f"(or {', '.join(DTYPE_ALIASES)})")


def canonical_dtype(dtype: str) -> str:
    """"bf16" -> "bfloat16", "fp32" -> "float32"; raises UnknownWeightDtype."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in WEIGHT_DTYPES:
        raise UnknownWeightDtype(dtype)
    return name


class Float32Linear(nn.Module):
    """fp32 weight [out, in]; the parity reference."""

    batch_invariant = False
    #: most rows per matmul for which the kernel stays batch-invariant (None: no limit).
    max_invariant_rows: int | None = None

    def __init__(self, in_features: int, out_features: int, *, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, device=device))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Float32Linear:
        module = cls(weight.shape[1], weight.shape[0], device="meta")
        module.weight = weight.float().contiguous()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class BFloat16Linear(Float32Linear):
    """bf16 weight [out, in]; bf16 activations into the matmul, fp32 out."""

    # Not declared invariant: oneDNN's blocking depends on the CPU and the row count (AMX: from
    # 33 rows; AVX-512 BF16: an n-row call differed from n one-row calls at n = 21, 29, 31 on
    # 48→80 and 64→40 shapes, measured 2026-12-01), so no row bound holds on every machine.
    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, *, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> BFloat16Linear:
        module = cls(weight.shape[1], weight.shape[0], device="meta")
        module.weight = weight.to(torch.bfloat16).contiguous()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


class Int8Linear(Float32Linear):
    """int8 weight [out, in'] + bf16 per-output-channel scales [out]; bf16 activations.

    in' is `in` rounded up to a multiple of 16 with zero columns: the kernel crashes on
    other row lengths once n >= 2 (torch 2.13 CPU); real models never need the padding.
    """

    batch_invariant = True
    k_multiple = 16

    def __init__(self, in_features: int, out_features: int, *, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.padded_in = -(-in_features // self.k_multiple) * self.k_multiple
        self.register_buffer("weight", torch.empty(out_features, self.padded_in, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        module = cls(weight.shape[1], weight.shape[0], device="meta")
        q, module.scales = quantize_int8(weight)
        module.weight = F.pad(q, (0, module.padded_in - module.in_features)).contiguous()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids, :self.in_features].float() * self.scales[ids].float()[:, None]


class Int4Linear(Float32Linear):
    """int4 weight-only, groupwise asymmetric: w ≈ (q - 8) · scale + zero per group of
    GROUP input columns, q in [0, 15]; bf16 activations; `aten._weight_int4pack_mm_for_cpu`.

    Half int8's bytes per weight, so a memory-bound one-row decode reads half as much (Gemma's
    262k x 640 LM head: ~5 ms vs ~13.5 ms int8 here); bitwise batch-invariant for the row
    counts a verify uses (tests/test_nn.py). The kernel wants out % 16 == 0 and in % GROUP == 0:
    both are padded with zeros. The kernel's packed layout is tiled, so `nibbles` keeps a plain
    copy ([out, in'/2], low nibble = even column) for `rows` (a tied embedding's gathers).
    """

    batch_invariant = True
    GROUP = 32
    N_MULTIPLE = 16

    def __init__(self, in_features: int, out_features: int, *, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.padded_in = -(-in_features // self.GROUP) * self.GROUP
        self.padded_out = -(-out_features // self.N_MULTIPLE) * self.N_MULTIPLE
        groups = self.padded_in // self.GROUP
        self.register_buffer("packed", torch.empty(self.padded_out, self.padded_in // 2, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("nibbles", torch.empty(self.padded_out, self.padded_in // 2, dtype=torch.uint8,
                                                    device=device))
        self.register_buffer("scales_zeros", torch.empty(groups, self.padded_out, 2, dtype=torch.bfloat16,
                                                         device=device))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int4Linear:
        module = cls(weight.shape[1], weight.shape[0], device="meta")
        w = F.pad(weight.float(), (0, module.padded_in - module.in_features, 0, module.padded_out - module.out_features))
        q, scales_zeros = quantize_int4(w, cls.GROUP)
        module._fill(q, scales_zeros)
        return module

    def _fill(self, q: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        """Set the buffers from padded int32 q [out', in'] in [0, 15] and bf16 [in'/GROUP, out', 2]."""
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        self.scales_zeros = scales_zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP, self.scales_zeros)
        return y[:, :self.out_features].float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.nibbles[ids].int()  # [n, in'/2]
        q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float()  # [n, in']
        sz = self.scales_zeros[:, ids].float()  # [groups, n, 2]
        scale = sz[..., 0].t().repeat_interleave(self.GROUP, dim=1)  # [n, in']
        zero = sz[..., 1].t().repeat_interleave(self.GROUP, dim=1)
        return ((q - 8) * scale + zero)[:, :self.in_features]


class GGUFLinear(Float32Linear):
    """The `gguf` weight mode's linear before the file is read: a meta placeholder that
    `resolve_gguf_linears` replaces by the class for its tensor's ggml types
    (`gguf_linear_class`). Built from float weights (no file blocks, e.g. a drafter swapped
    to its trunk's mode) it is an Int8Linear, as for an F32 tensor."""

    batch_invariant = True  # every class it resolves to is

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        return Int8Linear.from_float(weight)


class PartwiseLinear(nn.ModuleList):
    """A stacked linear whose parts need different classes (the `gguf` mode's rule for stacked
    tensors of mixed ggml types, `resolve_gguf_linears`): one linear per run of consecutive parts
    of one class, run in order and concatenated, [n, in] -> [n, out]. Each run is its own
    linear, so a row's output is bitwise what the parts give alone (and batch-invariant
    when they are); the runs cost one call each instead of one for the whole stack.

    part_rows: the source parts' rows of each run with more than one part (the child's name,
    "0", "1", ... -> rows), read by `gguf.load.plan_weights` as any module's `part_rows`.
    """

    def __init__(self, linears: Sequence[Float32Linear],
                 part_rows: Mapping[str, tuple[int, ...]] | None = None):
        super().__init__(linears)
        self.in_features = linears[0].in_features
        self.out_features = sum(m.out_features for m in linears)
        self.part_rows = dict(part_rows or {})

    @property
    def batch_invariant(self) -> bool:
        return all(m.batch_invariant for m in self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self], dim=-1)


LINEAR_CLASSES: dict[str, type[Float32Linear]] = {
    "float32": Float32Linear, "bfloat16": BFloat16Linear, "int8": Int8Linear, "int4": Int4Linear,
    "gguf": GGUFLinear,
}


def linear_class(dtype: str) -> type[Float32Linear]:
    """The linear module class for a weight dtype name; raises UnknownWeightDtype."""
    return LINEAR_CLASSES[canonical_dtype(dtype)]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (int8 [out, in], bf16 scales [out]), symmetric per output channel."""
    weight = weight.float()
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    for start in range(0, weight.shape[0], _ROW_CHUNK):
        w = weight[start:start + _ROW_CHUNK]
        wanted = w.abs().amax(dim=1).clamp(min=1e-30) / 127  # [rows]
        s = wanted.to(torch.bfloat16)
        s = torch.where(s.float() < wanted, torch.nextafter(s, torch.tensor(float("inf"), dtype=torch.bfloat16)), s)
        q[start:start + _ROW_CHUNK] = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + _ROW_CHUNK] = s
    return q, scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] (in % group == 0) -> (int32 q in [0, 15] [out, in], bf16 [in/group, out, 2]
    scale and zero with w ≈ (q - 8) · scale + zero), asymmetric min/max per group (gpt-fast's
    groupwise int4 convention)."""
    out, cols = weight.shape
    q = torch.empty(out, cols, dtype=torch.int32)
    scales_zeros = torch.empty(cols // group, out, 2, dtype=torch.bfloat16)
    for start in range(0, out, _ROW_CHUNK):
        w = weight[start:start + _ROW_CHUNK].reshape(-1, cols // group, group)  # [rows, groups, group]
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo).clamp(min=1e-30) / 15).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q[start:start + _ROW_CHUNK] = torch.round((w - zero) / scale + 8).clamp_(0, 15).to(torch.int32).flatten(1)
        scales_zeros[:, start:start + _ROW_CHUNK] = torch.stack([scale, zero], -1).squeeze(-2).transpose(0, 1)
    return q, scales_zeros


def swap_linears(model: nn.Module, dtype: str) -> nn.Module:
    """Replace every nn.Linear / verispec linear in `model` by `dtype`'s class, in place.

    A linear with real weights is converted (`from_float`); one on the meta device becomes
    an empty module of the new class on meta, to be filled by `load_state_dict(assign=True)`.
    Shared modules stay shared (a tied embedding and LM head remain one module).
    """
    cls = linear_class(dtype)

    def convert(_: str, old: nn.Module) -> nn.Module:
        weight = old.weight
        if weight.is_meta:
            return cls(weight.shape[1], weight.shape[0], device="meta")
        dense = old.rows(torch.arange(weight.shape[0])) if isinstance(old, Float32Linear) else weight
        return cls.from_float(dense.detach())

    return replace_linears(model, convert)


def replace_linears(model: nn.Module, make: Callable[[str, nn.Module], nn.Module]) -> nn.Module:
    """Set every linear of `model` to `make(module name, linear)`, called once per distinct module
    (shared modules stay shared, plain attributes that alias one follow it); in place."""
    made: dict[int, nn.Module] = {}
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):  # not named_children(): it skips repeats
            if isinstance(child, (nn.Linear, Float32Linear)):
                if id(child) not in made:
                    made[id(child)] = make(f"{prefix}.{name}" if prefix else name, child)
                setattr(parent, name, made[id(child)])
    for name, value in list(vars(model).items()):  # plain attributes that alias a replaced module
        if isinstance(value, nn.Module) and id(value) in made:
            setattr(model, name, made[id(value)])
    return model


def module_batch_invariant(model: nn.Module) -> bool:
    """True when every linear in `model` uses a batch-invariant kernel."""
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, Float32Linear))]
    return all(getattr(m, "batch_invariant", False) for m in linears)


#: rows per forward chunk when the caller does not choose: long enough for a fast prefill
#: (Gemma 3 270M int8, 500 tokens: 2.0 s in 16-row chunks, 1.6 s in 32, 1.2 s in 64),
#: capped where a dtype's kernel stops being batch-invariant.
DEFAULT_ROWS_PER_FORWARD = 64


def rows_per_forward(dtype: str) -> int:
    """The default chunk length for `dtype` (DEFAULT_ROWS_PER_FORWARD within its invariance limit)."""
    limit = linear_class(dtype).max_invariant_rows
    return DEFAULT_ROWS_PER_FORWARD if limit is None else min(limit, DEFAULT_ROWS_PER_FORWARD)
