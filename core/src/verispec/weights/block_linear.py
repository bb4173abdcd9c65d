"""The `gguf` weight mode's linear: a GGUF tensor's own quantised values in the block kernel.

`BlockLinear.from_gguf` unpacks the file's blocks (weights.gguf_blocks: u, s, m, nothing
requantised) and `pack`s them into the tiles `qmatmul.c` reads; the forward quantises each
activation row to int8 per 32 columns, as llama.cpp's CPU dot products do, and sums exact
integer products per group before one fp32 scale per group. `reference_matmul` states that
arithmetic in PyTorch (the tests hold the C kernel to it bitwise; it is also the path without
a C compiler), so a row's output depends on the row and the weights alone: batch-invariant
for any row count. On CUDA tensors the forward runs the same arithmetic in Triton
(kernels.triton_qmatmul, chosen by kernels.triton_dispatch.use_triton; `signed_values` is its weight).

One class per ggml type (`block_linear_class`): its buffers' shapes depend on the type's
format (4, 5, 6 or 8 bits a weight, groups of 16 or 32, fp16 scales or a K type's int8 × fp16 factors, mins or not).
Layers whose linears are all BlockLinears can also run whole in C (nn.layers).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from verispec.kernels import ckernels, triton_dispatch
from verispec.weights.gguf_blocks import BLOCK_FORMATS, SUPER_BLOCK, BlockFormat, BlockValues, GGUFBlocks, unpack
from verispec.weights.quant import Float32Linear

__all__ = ["BlockLinear", "block_linear_class", "pack", "reference_matmul", "quantize_activations", "signed_values"]

TILE = 16  # output rows per tile: one 16-lane fp32 vector
BLOCK = 32  # input columns per activation scale


def tile_block_bytes(bits: int) -> int:
    """Packed bytes of one tile's 32 columns (qmatmul.c's tile_block_bytes)."""
    return 512 if bits == 8 else 256 + 64 * (bits - 4)


def super_bytes(group: int) -> int:
    """Bytes of one tile's super-block of K-type scales (or mins): 16 fp16 factors, then int8
    [8 blocks, 32 / G, 16] (qmatmul.c's super_bytes)."""
    return 32 + 8 * (BLOCK // group) * TILE


def scale_kind(fmt: BlockFormat) -> int:
    """qmatmul.c's scale kind: 1 fp16 scales (and mins), 2 a K type's int8 × fp16 super-block factor."""
    return 1 if fmt.half_scales else 2


class BlockLinear(Float32Linear):
    """y fp32 [n, out] = x fp32 [n, in] · Wᵀ, W a GGUF tensor's values (in % 32 == 0).

    Buffers (layout: qmatmul.c): packed uint8 [tiles, in / 32, tile_block_bytes(bits)]; scales fp16
    [tiles, in / 32, 32 / G, 16] (the file's own fields), or for a K type (products d·sc) uint8
    [tiles, in / 256, super_bytes(G)]: per super-block the 16 rows' fp16 d, then the int8 sc of its
    8 blocks [8, 32 / G, 16]; mins like scales (or [0] for a type without mins), with tiles =
    ceil(out / 16), the last tile's missing rows zero.
    """

    batch_invariant = True
    #: set by `TrunkModule.to_device`: never the C kernels (their pointers are the CPU's); the Triton
    #: kernel where `triton_dispatch.use_triton`, else `reference_matmul` on the tensors' device
    device_kernels = False
    FORMAT: BlockFormat
    GGML_TYPE: GGMLQuantizationType

    def __init__(self, in_features: int, out_features: int, *, device=None):
        torch.nn.Module.__init__(self)
        if in_features % BLOCK:
            raise ValueError(f"a {self.GGML_TYPE.name} linear needs in_features % {BLOCK} == 0, not {in_features}")
        self.in_features, self.out_features = in_features, out_features
        tiles, nb, fmt = -(-out_features // TILE), in_features // BLOCK, self.FORMAT
        self.register_buffer("packed", torch.empty(tiles, nb, tile_block_bytes(fmt.bits), dtype=torch.uint8,
                                                   device=device))
        if fmt.half_scales:
            groups, dtype = (tiles, nb, BLOCK // fmt.group, TILE), torch.float16
        else:
            groups, dtype = (tiles, in_features // SUPER_BLOCK, super_bytes(fmt.group)), torch.uint8
        self.register_buffer("scales", torch.empty(groups, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(groups if fmt.has_mins else (0,), dtype=dtype, device=device))
        self._kernel: tuple | None = None  # (packed tensor, kernel_args()) once computed
        self._unpacked: tuple | None = None  # (packed tensor, values()) for the PyTorch path
        self._signed: tuple | None = None  # (packed tensor, signed_values(...) on the device): a placed trunk's

    @classmethod
    def from_gguf(cls, parts: Sequence[GGUFBlocks]) -> BlockLinear:
        """parts: tensors of this class's type with equal `cols`, stacked along rows (e.g. gate
        and up read as one fused weight). Raises ValueError for blocks whose fp16 fields are
        not what the type declares (never for a file gguf-py reads)."""
        values = [unpack(p) for p in parts]
        u = torch.cat([v.u for v in values])
        s = torch.cat([v.s for v in values])
        m = torch.cat([v.m for v in values]) if cls.FORMAT.has_mins else None
        factors = None
        if values[0].factors is not None:  # a K type: stack each factor
            factors = tuple(None if f[0] is None else torch.cat(f) for f in zip(*(v.factors for v in values)))
        module = cls(parts[0].cols, u.shape[0], device="meta")
        module.packed, module.scales, mins = pack(BlockValues(cls.FORMAT, u, s, m, factors))
        module.mins = torch.empty(0, dtype=module.scales.dtype) if mins is None else mins
        return module

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Float32Linear:
        raise TypeError(f"{cls.__name__} holds a GGUF file's {cls.GGML_TYPE.name} blocks; it is built by "
                        "from_gguf, never from float weights")

    def values(self, ids: torch.Tensor | None = None) -> BlockValues:
        """The unpacked values of output rows `ids` (all when None); only their tiles are read.
        Raises IndexError for an id outside [0, out_features)."""
        ids = torch.arange(self.out_features) if ids is None else ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features}): got {int(ids.min())}..{int(ids.max())}")
        tiles, lane = torch.unique(ids // TILE, return_inverse=True)
        mins = self.mins[tiles] if self.FORMAT.has_mins else None
        u, s, m = unpack_tiles(self.FORMAT, self.packed[tiles], self.scales[tiles], mins)
        at = lane * TILE + ids % TILE
        return BlockValues(self.FORMAT, u[at], s[at], None if m is None else m[at])

    def kernel_args(self) -> tuple:
        """The weight's arguments to ckernels.qmatmul (pointers and format), computed once per
        packed tensor: a forward runs ~100 times a token, and reading pointers costs µs."""
        packed = self._buffers["packed"]
        if self._kernel is None or self._kernel[0] is not packed:
            fmt = self.FORMAT
            mins = self.mins.data_ptr() if fmt.has_mins else None
            self._kernel = (packed, (packed.data_ptr(), self.scales.data_ptr(), mins, self.out_features,
                                     fmt.bits, fmt.group, fmt.zero, scale_kind(fmt)))
        return self._kernel[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
            x = x.reshape(-1, self.in_features).float().contiguous()
        if triton_dispatch.use_triton(x):  # CUDA tensors: the same arithmetic in Triton
            from verispec.kernels import triton_qmatmul

            y = triton_qmatmul.qmatmul(*quantize_activations(x), *self.device_weight(x.device), self.FORMAT.group)
        elif self.device_kernels:  # a trunk on a device with VERISPEC_TRITON=0: the PyTorch statement there
            w, s, m = self.device_weight(x.device)
            y = _reference_matmul(x, self.FORMAT, w, 0, s, m)
        elif ckernels.library() is None:  # no C compiler: the kernel's arithmetic in PyTorch
            if self._unpacked is None or self._unpacked[0] is not self._buffers["packed"]:
                self._unpacked = (self._buffers["packed"], self.values())  # a byte a weight, kept
            y = reference_matmul(x, self._unpacked[1])
        else:
            y = torch.empty(x.shape[0], self.out_features)
            ckernels.qmatmul(x, self.kernel_args(), y)
        return y if len(lead) == 1 else y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse=True):
        """nn.Module's `.to` / `.cpu` / ...: a placed trunk's block linear (`device_kernels`, set by
        `TrunkModule.to_device` before it moves the modules) keeps its packed blocks on the CPU:
        they are only the source of the one copy its device kernels read (`device_weight`)."""
        return self if self.device_kernels else super()._apply(fn, recurse)

    def device_weight(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The weight a placed trunk reads, made once per packed tensor: `signed_values` of the
        unpacked blocks on `device` (w int8 [out, in], s fp32 [out, in / G], m fp32 or None). The
        Triton matmul, its PyTorch statement and the row gather all read this one copy."""
        packed = self._buffers["packed"]
        if self._signed is None or self._signed[0] is not packed:
            self._signed = None  # the old copy goes before the new one is made
            self._signed = (packed, tuple(None if t is None else t.to(device) for t in signed_values(self._cpu_values())))
        return self._signed[1]

    def _cpu_values(self) -> BlockValues:
        """The unpacked values (u uint8 [out, in], s and m fp32 [out, in / G]) on the CPU, from CPU
        copies of the packed buffers (unpack_tiles builds its bit masks on the CPU)."""
        mins = self.mins.cpu() if self.FORMAT.has_mins else None
        u, s, m = unpack_tiles(self.FORMAT, self._buffers["packed"].cpu(), self.scales.cpu(), mins)
        rows = slice(0, self.out_features)
        return BlockValues(self.FORMAT, u[rows], s[rows], None if m is None else m[rows])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [n, in]: rows `ids` dequantised, gguf-py's values bitwise (a tied embedding's lookup;
        the C kernel reads the packed rows in place, else their unpacked values)."""
        if self.device_kernels:  # gguf-py's values from the device weight: (u - z)·s, or u·s + m (z = 0)
            w, s, m = self.device_weight(ids.device)
            y = w[ids].float() * s[ids].repeat_interleave(self.FORMAT.group, dim=1)
            return y if m is None else y + m[ids].repeat_interleave(self.FORMAT.group, dim=1)
        if ckernels.library() is None:
            return self.values(ids).dequantize()
        return ckernels.block_rows(self.kernel_args(), self.in_features, ids)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, type={self.GGML_TYPE.name}"


@functools.cache
def block_linear_class(ggml_type: GGMLQuantizationType) -> type[BlockLinear]:
    """The BlockLinear subclass for one of weights.gguf_blocks.BLOCK_FORMATS' types (KeyError otherwise)."""
    fmt = BLOCK_FORMATS[ggml_type]
    return type(f"{ggml_type.name}Linear", (BlockLinear,), {"FORMAT": fmt, "GGML_TYPE": ggml_type,
                                                             "__module__": __name__})


def pack(values: BlockValues) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """u, s, m -> the kernel's (packed, scales, mins) buffers (qmatmul.c's layout)."""
    fmt = values.format
    rows, cols = values.u.shape
    pad = -rows % TILE
    tiles, nb = (rows + pad) // TILE, cols // BLOCK
    u = F.pad(values.u, (0, 0, 0, pad)).reshape(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [t, b, j, r, e]
    if fmt.bits == 8:
        packed = u.reshape(tiles, nb, -1).contiguous()
    else:
        low = u & 15
        parts = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(tiles, nb, -1)]  # 256 bytes
        weights = 1 << torch.arange(8, dtype=torch.uint8)
        for p in range(4, fmt.bits):  # a plane: word j's bit 4r + e is bit p of u[r][4j + e], little-endian
            bits = ((u >> p) & 1).reshape(tiles, nb, 8, 8, 8)  # [t, b, j, byte, bit]
            parts.append((bits * weights).sum(-1, dtype=torch.uint8).reshape(tiles, nb, 64))
        packed = torch.cat(parts, dim=-1).contiguous()

    def groups(x: torch.Tensor) -> torch.Tensor:  # [rows, nb·gpb] -> [tiles, nb, gpb, 16]
        return F.pad(x, (0, 0, 0, pad)).reshape(tiles, TILE, nb, BLOCK // fmt.group).permute(0, 2, 3, 1)

    def half(x: torch.Tensor) -> torch.Tensor:
        if not ((x.half().float() == x) | x.isnan()).all():
            raise ValueError("scales declared fp16 are not fp16 values")
        return x.half().contiguous()

    if fmt.half_scales:
        return packed, half(groups(values.s)), None if values.m is None else half(groups(values.m))
    if values.factors is None:
        raise ValueError(f"{fmt} scales are products: pack needs their factors (gguf_blocks.unpack gives them)")
    s_super, s_int, m_super, m_int = values.factors

    def super_blocks(factor: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:  # -> uint8 [tiles, ns, bytes]
        ns = nb * BLOCK // SUPER_BLOCK
        f = half(F.pad(factor, (0, 0, 0, pad)).reshape(tiles, TILE, ns).permute(0, 2, 1))  # [t, ns, 16]
        i = groups(ints).reshape(tiles, ns, -1)  # int8 [t, ns, 8·gpb·16]
        return torch.cat([f.view(torch.uint8), i.contiguous().view(torch.uint8)], dim=-1).contiguous()

    return packed, super_blocks(s_super, s_int), None if m_super is None else super_blocks(m_super, m_int)


def unpack_tiles(fmt: BlockFormat, packed: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`pack`'s inverse: u uint8 [tiles·16, in], s (and m) fp32 [tiles·16, in / G] (exact: a K
    type's factors multiplied back in fp32)."""
    tiles, nb, _ = packed.shape
    if fmt.bits == 8:
        p = packed.reshape(tiles, nb, 8, TILE, 4)
    else:
        low = packed[..., :256].reshape(tiles, nb, 4, TILE, 4)
        p = torch.cat([low & 15, low >> 4], dim=2)  # [t, b, j, r, e]
        for plane, bit in enumerate(range(4, fmt.bits)):
            words = packed[..., 256 + 64 * plane:320 + 64 * plane].reshape(tiles, nb, 8, 8, 1)  # [t, b, j, byte, 1]
            bits = (words >> torch.arange(8, dtype=torch.uint8)) & 1
            p = p | (bits.reshape(tiles, nb, 8, TILE, 4) << bit)
    u = p.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, nb * BLOCK)

    def flat(x: torch.Tensor) -> torch.Tensor:
        if not fmt.half_scales:  # uint8 [t, ns, bytes] -> d · sc as fp32 [t, nb, gpb, 16]
            ns, gpb = x.shape[1], BLOCK // fmt.group
            factor = x[..., :2 * TILE].contiguous().view(torch.float16).float()  # [t, ns, 16]
            ints = x[..., 2 * TILE:].contiguous().view(torch.int8).float().reshape(tiles, ns, 8, gpb, TILE)
            x = (factor[:, :, None, None, :] * ints).reshape(tiles, nb, gpb, TILE)
        return x.permute(0, 3, 1, 2).reshape(tiles * TILE, -1).float()

    return u, flat(scales), None if mins is None else flat(mins)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qmatmul.c's activation rounding: x fp32 [n, k] -> (a int8 [n, k], d fp32 [n, k / 32],
    S int32 [n, k / 16]) with d = amax / 127, a = rint(x / d) computed as x · (1 / d)."""
    n, k = x.shape
    blocks = x.reshape(n, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = amax / torch.full_like(amax, 127.0)  # ATen divides by a 0-dim tensor as a · (1 / b): not C's a / b
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    a = torch.round(blocks * inv[..., None]).to(torch.int8).reshape(n, k)
    return a, d, a.reshape(n, k // 16, 16).int().sum(dim=-1, dtype=torch.int32)


def signed_values(values: BlockValues) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The Triton kernel's weight (kernels.triton_qmatmul): w = u - z int8 [rows, cols] (exact:
    every type's u - z is in [-128, 127]), s and m fp32 contiguous."""
    w = (values.u.to(torch.int16) - values.format.zero).to(torch.int8).contiguous()
    return w, values.s.float().contiguous(), None if values.m is None else values.m.float().contiguous()


def reference_matmul(x: torch.Tensor, values: BlockValues, chunk: int = 8192) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (qmatmul.c's header), `chunk` output rows at a time:
    x fp32 [n, k] -> fp32 [n, out]. Integer sums are exact in fp32 (|sum| < 2^24), so any order
    gives them; the fp32 steps run in the kernel's order."""
    return _reference_matmul(x, values.format, values.u, values.format.zero, values.s, values.m, chunk)


def _reference_matmul(x: torch.Tensor, fmt: BlockFormat, u: torch.Tensor, zero: int, s: torch.Tensor,
                      m: torch.Tensor | None, chunk: int = 8192) -> torch.Tensor:
    """`reference_matmul` of integer weights u [out, k] with zero point `zero` (the unpacked u and
    the type's z, or the signed w = u - z and 0: the same exact integer sums, the same bits)."""
    n, k = x.shape
    a, d, S = quantize_activations(x)
    groups, g = k // fmt.group, fmt.group
    Sg = S if g == 16 else S[:, 0::2] + S[:, 1::2]  # [n, groups]
    dg = d.repeat_interleave(BLOCK // g, dim=1)  # [n, groups]: each group's block scale
    a_g = a.float().reshape(n, groups, g).transpose(0, 1)  # [groups, n, g]
    out = []
    for start in range(0, u.shape[0], chunk):
        ut = u[start:start + chunk].float().reshape(-1, groups, g).permute(1, 2, 0)  # [groups, g, rows]
        I = torch.bmm(a_g, ut) - (zero * Sg).float().t()[:, :, None]  # [groups, n, rows], exact
        st = s[start:start + chunk]
        mt = None if m is None else m[start:start + chunk]
        y = torch.zeros(n, st.shape[0], device=x.device)
        for h in range(groups):
            y = y + I[h] * (st[None, :, h] * dg[:, h, None])
            if mt is not None:
                y = y + (mt[None, :, h] * dg[:, h, None]) * Sg[:, h, None].float()
        out.append(y)
    return torch.cat(out, dim=1)
