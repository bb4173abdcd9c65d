"""Whole decoder layers in C (layers.c): the families' layer modules hand their weights here
once (`DecoderLayerKernel`, when every linear is block-packed, the `gguf` weight mode, and the
C kernels are built), and `forward_layers` runs each run of consecutive such layers as one C
call per forward. The arithmetic is the op-by-op forward's with the C kernels, so the two give
the same bits (`verispec.testing.gguf_weights.assert_fused_layers_are_op_by_op`, run by each
family's test_fused_layer.py); what goes is the per-op and per-layer dispatch, most of a small
model's one-row decode (SmolLM2-135M: ~18 µs of Python a layer when each layer was its own call).
"""
from __future__ import annotations

import ctypes

import torch

from verispec.kernels import ckernels
from verispec.nn.attention import descriptor_rows
from verispec.weights.block_linear import BlockLinear
from verispec.weights.quant import PartwiseLinear

__all__ = ["DecoderLayerKernel", "block_parts", "forward_layers", "fused_kernel"]

MAX_PARTS = 4


class _QWeight(ctypes.Structure):  # kernels.h verispec_qweight
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("m", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("bits", ctypes.c_int64), ("group", ctypes.c_int64), ("zero", ctypes.c_int64),
                ("kind", ctypes.c_int64)]


class _Linear(ctypes.Structure):  # layers.c linear
    _fields_ = [("parts", ctypes.c_int64), ("part", _QWeight * MAX_PARTS)]


class _DecoderLayer(ctypes.Structure):  # layers.c decoder_layer
    _fields_ = [*[(name, ctypes.c_int64) for name in ("D", "H", "Hkv", "Dh", "F", "rotary_dim", "neox", "act")],
                ("eps", ctypes.c_float), ("scaling", ctypes.c_float),
                *[(name, ctypes.c_void_p) for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm",
                                                       "q_norm", "k_norm", "qkv_bias", "o_bias")],
                *[(name, _Linear) for name in ("qkv", "o", "gate_up", "down")]]


def block_parts(linear) -> list[BlockLinear] | None:
    """The block linears a linear runs, in output order (a PartwiseLinear's runs), or None when
    any part is of another class or there are more than MAX_PARTS."""
    parts = list(linear) if isinstance(linear, PartwiseLinear) else [linear]
    if len(parts) > MAX_PARTS or not all(isinstance(p, BlockLinear) for p in parts):
        return None
    return parts


def _linear(parts: list[BlockLinear]) -> _Linear:
    out = _Linear(parts=len(parts))
    for i, part in enumerate(parts):
        out.part[i] = _QWeight(*part.kernel_args())
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class DecoderLayerKernel:
    """One pre-norm decoder layer's weights for `verispec_decoder_layers` (layers.c): llama /
    qwen2 (input and pre-FF norms, q|k|v and o biases, SwiGLU) and Gemma 3 (sandwich norms,
    per-head q/k norms, GeGLU, sliding windows). The layer's tensors must stay alive and
    unchanged while it is used (`fused_kernel` rebuilds it when a linear or its packed weights
    are replaced: `current`)."""

    def __init__(self, *, qkv: list, o, gate_up, down, input_norm: torch.Tensor, pre_ff_norm: torch.Tensor,
                 post_attn_norm: torch.Tensor | None = None, post_ff_norm: torch.Tensor | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 qkv_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate_size: int, rotary_dim: int, neox: bool,
                 activation: str, eps: float, scaling: float, sliding_window: int | None = None):
        """qkv: the linears whose outputs side by side are q|k|v (one stacked linear, or three).
        Raises ValueError when a linear is not block-packed, a linear runs more than MAX_PARTS
        parts, or RoPE spans over 1024 dims."""
        per_linear = [block_parts(m) for m in (*qkv, o, gate_up, down)]
        if None in per_linear or rotary_dim > 1024:
            raise ValueError("a fused layer needs block-packed linears (the gguf weight mode) and RoPE over "
                             "at most 1024 dims")
        parts = [[p for ps in per_linear[:len(qkv)] for p in ps], *per_linear[len(qkv):]]
        if len(parts[0]) > MAX_PARTS:
            raise ValueError(f"q|k|v runs {len(parts[0])} parts; a fused layer takes at most {MAX_PARTS}")
        self.linears = (*qkv, o, gate_up, down)
        self._packed = [(p, p._buffers["packed"]) for ps in per_linear for p in ps]
        self._tensors = (input_norm, post_attn_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm, qkv_bias, o_bias)
        self.args = _DecoderLayer(qkv[0].in_features, num_heads, num_kv_heads, head_dim, intermediate_size,
                                  rotary_dim, int(neox), ACTIVATIONS[activation], eps, scaling,
                                  *map(_ptr, self._tensors), *map(_linear, parts))
        self.sliding_window = sliding_window

    @staticmethod
    def run(kernels: list, h: torch.Tensor, cos_sin: list, rows, first: int) -> torch.Tensor:
        """`verispec_decoder_layers` over layers first .. first + len(kernels) - 1: h fp32 [n, D] ->
        fp32 [layers, n, D], the residual after each (see forward_layers)."""
        h = h.contiguous()
        n, num_layers = h.shape[0], len(kernels)
        desc, threads = [], []
        for i, kernel in enumerate(kernels):
            caches = [s.state.layers[first + i] for s in rows.sequences]
            layer_desc, work = descriptor_rows(caches, rows, write=True, sliding_window=kernel.sliding_window)
            desc += layer_desc
            threads.append(ckernels.attend_threads(work * kernel.args.H))
        desc = torch.tensor(desc, dtype=torch.int64)
        threads = torch.tensor(threads, dtype=torch.int64)
        pointers = ctypes.c_void_p * num_layers
        out = torch.empty(num_layers, *h.shape)
        status = ckernels.library().verispec_decoder_layers(
            pointers(*[ctypes.addressof(k.args) for k in kernels]), num_layers, h.data_ptr(), out.data_ptr(), n,
            pointers(*[cos.data_ptr() for cos, _ in cos_sin]), pointers(*[sin.data_ptr() for _, sin in cos_sin]),
            desc.data_ptr(), len(rows.sequences), threads.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError("the fused layers could not allocate their scratch")
        return out

    def watch(self, layer, paths: tuple[str, ...]) -> None:
        """Remember the module links from `layer` down to its linears at `paths` (dotted
        submodule names, as `layer.get_submodule` takes), for `current`."""
        links = {}
        for path in paths:
            parent = layer
            for name in path.split("."):
                child = parent._modules[name]
                links[id(parent._modules), name] = (parent._modules, name, child)
                parent = child
        self._links = list(links.values())

    def current(self) -> bool:
        """Whether every watched link still holds the module it held, and every linear the packed
        tensor this kernel points at (dict lookups only: a forward asks once a layer)."""
        for modules, name, module in self._links:
            if modules.get(name) is not module:
                return False
        for p, packed in self._packed:
            if p._buffers["packed"] is not packed:
                return False
        return True


def fused_kernel(layer, paths: tuple[str, ...], make) -> DecoderLayerKernel | None:
    """A family layer's kernel for this forward, kept in `layer._kernel`: the kept one while it is
    `current()`, else `make()` (a new DecoderLayerKernel over the linears at `paths`, dotted
    submodule names of `layer`); None where the layer cannot run fused (the C kernels not built, a
    linear not block-packed). `_kernel` is set only when it changes (nn.Module.__setattr__ costs
    µs)."""
    cached = layer._kernel
    if cached is not None and cached.current():
        return cached
    linears = [layer.get_submodule(path) for path in paths]
    fusable = ckernels.library() is not None and None not in [block_parts(m) for m in linears]
    kernel = make() if fusable else None
    if kernel is not None:
        kernel.watch(layer, paths)
    if kernel is not cached:
        layer._kernel = kernel
    return kernel


def forward_layers(kernels: list, h: torch.Tensor, cos_sin: list, rows, layer_forward) -> list[torch.Tensor]:
    """h fp32 [n, D] through a family's layers in order: layer i runs as `kernels[i]` (a
    DecoderLayerKernel; consecutive ones in one C call) or, where that is None, as
    `layer_forward(i, x)`. cos_sin[i]: layer i's RoPE tables, fp32 contiguous [n, 1, rotary_dim]
    each (`RotaryEmbedding.cos_sin`); rows: the forward's nn.trunk.Rows, whose sequences' caches
    of layer i take its K/V. Returns the residual after each layer, fp32 [n, D] each. Raises
    MemoryError when the kernel's scratch allocation fails."""
    outs, i = [], 0
    while i < len(kernels):
        if kernels[i] is None:
            outs.append(layer_forward(i, outs[-1] if outs else h))
            i += 1
            continue
        end = i
        while end < len(kernels) and kernels[end] is not None:
            end += 1
        outs.extend(DecoderLayerKernel.run(kernels[i:end], outs[-1] if outs else h, cos_sin[i:end], rows, i))
        i = end
    return outs

