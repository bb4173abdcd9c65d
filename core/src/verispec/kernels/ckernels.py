"""The kernels every family shares (`kernels.c`, `qmatmul.c`, `layers.c`), called through ctypes.

- `attend`: `attention.attend_rows` runs every row of every sequence of a forward through it
  in one call (an attention softcap takes the PyTorch path in `attention`).
- `qmatmul` / `block_rows`: the `gguf` weights' block matmul and row gather (weights.block_linear).
- `glu`, `rms_norm`, and `verispec_decoder_layers` (nn.layers' fused layers).
Without them (no C compiler, `VERISPEC_C_KERNELS=0`) the PyTorch paths run. Each kernel fixes
its own order of fp32 operations per row, so a row's bits never depend on the other rows or
sequences of the call (the batch invariance speculation needs), and `reference_attend` /
`reference_glu` / `reference_rms_norm` below state that order in PyTorch: the tests check the
kernels against them bitwise.

Built by `kernels.build.CLibrary` (~2 s, no torch headers, once per machine and source).
`python -m verispec.kernels.ckernels` builds it ahead of time (`scripts/setup.sh` does).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from verispec.kernels.build import CLibrary


def _declare(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the shared kernels."""
    lib.verispec_attend.restype = ctypes.c_int
    lib.verispec_attend.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                    ctypes.c_int64]
    lib.verispec_qmatmul.restype = ctypes.c_int
    lib.verispec_qmatmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64]
    for glu in (lib.verispec_silu_mul, lib.verispec_gelu_tanh_mul):
        glu.restype = None
        glu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.verispec_decoder_layers.restype = ctypes.c_int
    lib.verispec_decoder_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.verispec_block_rows.restype = ctypes.c_int
    lib.verispec_block_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        *[ctypes.c_int64] * 6, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.verispec_rms_norm.restype = None
    lib.verispec_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_float]


LIBRARY = CLibrary("kernels", [Path(__file__).with_name(name) for name in ("kernels.c", "qmatmul.c", "layers.c")],
                   [Path(__file__).with_name("kernels.h")], declare=_declare,
                   fallback="attention, RMSNorm and the gguf linears run on the slower PyTorch path, and the "
                            "gemma/llama families default to int8 weights (gguf's PyTorch path is ~20x slower)")


def library() -> ctypes.CDLL | None:
    """The shared kernels, built on first use (`LIBRARY.load()`); None when unavailable."""
    return LIBRARY.load()


#: rows x heads x slots below which one thread does the call: the kernels run on torch's OpenMP
#: team (waking it costs a few µs), and a call this small takes ~0.1 ms on one thread.
PARALLEL_WORK = 1 << 14


def attend_threads(work: int) -> int:
    """Threads for an attention call reading `work` rows x heads x slots: torch's count, or 1
    below PARALLEL_WORK."""
    return torch.get_num_threads() if work >= PARALLEL_WORK else 1


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor, desc: torch.Tensor,
           num_kv_heads: int, scaling: float, work: int = 0) -> None:
    """Run the kernel: q, out fp32 contiguous [rows, H, Dh]; k, v fp32 contiguous [rows, Hkv, Dh],
    written into the blocks first (each cache's `prepare_write` done), or None; desc int64 contiguous
    [sequences, 9], per sequence (the C enum's order): its first row in q, its row count, the
    position of its first row, the slots it reads, the block size, the data pointers of its K
    and V block tables and of its slot positions (0: slot = position), the sliding window (0:
    none); the caller's caches keep the tables alive. work: rows x heads x slots, to decide on
    threads (torch's thread count).
    Raises MemoryError when the kernel's scratch allocation fails."""
    _, num_heads, head_dim = q.shape
    threads = attend_threads(work)
    k_ptr, v_ptr = (None, None) if k is None else (k.data_ptr(), v.data_ptr())
    if library().verispec_attend(q.data_ptr(), k_ptr, v_ptr, out.data_ptr(), desc.data_ptr(), desc.shape[0], num_heads,
                                 num_kv_heads, head_dim, scaling, threads) != 0:
        raise MemoryError("the attention kernel could not allocate its scratch scores")


def reference_attend(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor,
                     positions: torch.Tensor, *, scaling: float, window: int | None = None) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, one fp32 operation per step in the kernel's order (slow:
    for tests). q fp32 [n, H, Dh] at `positions` int64 [n]; k_t fp32 [Hkv, Dh, T] (keys
    transposed), v fp32 [Hkv, T, Dh], slot_pos int64 [T] (-1 = empty). Returns fp32 [n, H, Dh]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, _, num_slots = k_t.shape
    k_rows = k_t.repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, Dh, T]
    v_rows = v.repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, T, Dh]
    scores = torch.zeros(n, num_heads, num_slots)
    for d in range(head_dim):
        scores = scores + q[:, :, d, None] * k_rows[None, :, d, :]
    scores = scores * _f32(scaling)
    p = positions[:, None, None]
    visible = (slot_pos >= 0) & (slot_pos <= p)
    if window:
        visible &= p - slot_pos < window
    m = scores.masked_fill(~visible, float("-inf")).amax(dim=-1, keepdim=True)
    e = _reference_exp(scores - m)
    den = torch.zeros(n, num_heads, 1)
    o = torch.zeros(n, num_heads, head_dim)
    for t in range(num_slots):
        e_t = torch.where(visible[:, :, t:t + 1], e[:, :, t:t + 1], torch.zeros(()))
        # a masked slot adds e_t = 0: x + 0 and x + 0 * v are x bitwise (v finite), as skipping it is
        den = den + e_t
        o = o + e_t * v_rows[None, :, t, :]
    return o / den


def qmatmul(x: torch.Tensor, weight_args: tuple, y: torch.Tensor) -> None:
    """y fp32 contiguous [n, out] = x fp32 contiguous [n, k] times a block-packed weight
    (weights.block_linear.pack; arithmetic: qmatmul.c, `block_linear.reference_matmul`).
    weight_args: `block_linear.BlockLinear.kernel_args()`, the weight's pointers and format
    (packed, scales, mins or None, out, bits, group, zero, scale kind). Runs on torch's OpenMP team
    (torch's thread count). Raises MemoryError when the activations' scratch cannot be
    allocated, ValueError for a format qmatmul.c has no kernel for (not one of
    weights.gguf_blocks.BLOCK_FORMATS)."""
    n, k = x.shape
    status = library().verispec_qmatmul(x.data_ptr(), n, k, *weight_args, y.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise ValueError(f"qmatmul.c has no kernel for (bits, group, zero, scale kind) = {weight_args[4:]}")
    if status != 0:
        raise MemoryError("the block matmul could not allocate its activation scratch")


def block_rows(weight_args: tuple, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [n, in_features]: rows `ids` (int64 [n]) of a block-packed weight dequantised,
    gguf-py's values bitwise (qmatmul.c `verispec_block_rows`; `BlockValues.dequantize` states
    it). weight_args: `BlockLinear.kernel_args()`. Raises IndexError for an id outside the
    weight's rows."""
    packed, scales, mins, rows, bits, group, zero, kind = weight_args
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), in_features)
    if library().verispec_block_rows(packed, scales, mins, rows, in_features, bits, group, zero, kind,
                                     ids.data_ptr(), ids.numel(), out.data_ptr()) != 0:
        raise IndexError(f"row ids must be in [0, {rows}): got {int(ids.min())}..{int(ids.max())}")
    return out


def glu(activation: str, gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """A gated MLP's act(gate) · up, activation "silu" (SwiGLU) or "gelu_tanh" (GeGLU):
    gate_up fp32 contiguous [n, 2F] (gate | up) -> fp32 [n, F] (arithmetic: `reference_glu`)."""
    n = gate_up.shape[0]
    out = torch.empty(n, width)
    kernel = library().verispec_silu_mul if activation == "silu" else library().verispec_gelu_tanh_mul
    kernel(gate_up.data_ptr(), out.data_ptr(), n, width)
    return out


def reference_glu(activation: str, gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """`verispec_silu_mul` / `verispec_gelu_tanh_mul` of layers.c, operation by operation."""
    g, u = gate_up[:, :width], gate_up[:, width:]
    one = torch.ones_like(g)
    if activation == "silu":
        e = _reference_exp(-g.abs())
        return (g * (torch.where(g < 0, e, one) / (one + e))) * u
    y = _f32(0.7978845608) * (g + _f32(0.044715) * ((g * g) * g))
    e = _reference_exp(-y.abs() * _f32(2.0))
    t = torch.copysign((one - e) / (one + e), y)
    return ((_f32(0.5) * g) * (one + t)) * u


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x fp32 contiguous [..., dim], weight fp32 [dim] or None ->
    fp32 [..., dim] (arithmetic: `reference_rms_norm`)."""
    if weight is not None and (weight.dtype != torch.float32 or not weight.is_contiguous()):
        weight = weight.float().contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().verispec_rms_norm(x.data_ptr(), None if weight is None else weight.data_ptr(), out.data_ptr(),
                                x.numel() // dim if dim else 0, dim, eps)
    return out


def lane_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, 1]: each row's sum of squares in `verispec_rms_norm`'s fixed order (16 lanes
    over the row's 16-wide chunks, a zero-padded tail, then halving 8, 4, 2, 1), x fp32 [rows,
    dim]. Elementwise steps only: a row's bits depend on nothing else, on any device."""
    rows, dim = x.shape
    lanes = torch.zeros(rows, 16, device=x.device)
    padded = torch.nn.functional.pad(x, (0, -dim % 16))
    for chunk in padded.split(16, dim=1):
        lanes = lanes + chunk * chunk
    for half in (8, 4, 2, 1):
        lanes = lanes[:, :half] + lanes[:, half:2 * half]
    return lanes


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`verispec_rms_norm` of the C file, operation by operation: x fp32 [rows, dim]."""
    dim = x.shape[1]
    lanes = lane_sum_of_squares(x)
    # ATen divides by a 0-dim tensor as a * (1 / b), and its fp32 sqrt is not correctly rounded
    # (the C sqrtf is): divide by a full tensor, and take sqrt in fp64 (exact once rounded to fp32)
    mean = lanes / torch.full_like(lanes, dim) + _f32(eps)
    root = torch.sqrt(mean.double()).float()
    inv = torch.ones_like(root) / root
    out = x * inv
    return out if weight is None else out * weight


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _reference_exp(x: torch.Tensor) -> torch.Tensor:
    """`vexp` of the C file, operation by operation."""
    x = torch.maximum(x, _f32(-80.0))
    magic = _f32(12582912.0)
    n = (x * _f32(1.44269504088896341) + magic) - magic
    r = x - n * _f32(0.693359375)
    r = r - n * _f32(-2.12194440e-4)
    p = _f32(1.9875691500e-4).expand_as(r)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + _f32(c)
    y = p * (r * r)
    y = y + r
    y = y + _f32(1.0)
    bits = (n.to(torch.int32) + 127) << 23
    return y * bits.view(torch.float32)


if __name__ == "__main__":
    print(LIBRARY.build())
    sys.exit(0 if library() is not None else 1)
