"""The `gguf` weight mode: a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 blocks reach the
block kernel unrequantised (weights.gguf_blocks, weights.block_linear, qmatmul.c), other types go to
int8; checked against `gguf.quants.dequantize` on random stored blocks (every bit pattern of
the packed fields), the C kernel against its PyTorch statement bitwise, through the loader and
the weight cache, and for batch invariance."""
import ctypes
import itertools

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize
from torch import nn

from verispec import weight_cache
from verispec.gguf.io import GGUFFile
from verispec.gguf.load import plan_weights
from verispec.gguf.table import Stack, Tensor
from verispec.kernels import ckernels
from verispec.weights.block_linear import block_linear_class, quantize_activations, reference_matmul
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack
from verispec.weights.gguf_mode import UnmappedGGUFType
from verispec.weights.quant import (
    GGUFLinear,
    Int8Linear,
    PartwiseLinear,
    canonical_dtype,
    module_batch_invariant,
    rows_per_forward,
    swap_linears,
)
from verispec.testing.fixture_writer import write_gguf
from verispec.testing.gguf_weights import random_blocks

TYPES = sorted(BLOCK_FORMATS)
needs_kernels = pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: the kernels are not built")


def _blocks(ggml_type, raw, cols):
    return GGUFBlocks(ggml_type, torch.from_numpy(raw.copy()), cols)


def _linear(ggml_type, rows=40, cols=512, seed=0):
    """A block linear of random stored blocks (40 rows: the last tile padded), and the blocks."""
    blocks = _blocks(ggml_type, random_blocks(ggml_type, rows, cols, seed), cols)
    return block_linear_class(ggml_type).from_gguf([blocks]), blocks


def _x(n, cols, seed=3):
    return torch.randn(n, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_unpacked_values_are_the_files_weights_bitwise(ggml_type):
    cols = 512
    raw = random_blocks(ggml_type, 40, cols)
    values = unpack(_blocks(ggml_type, raw, cols))
    fmt = values.format
    assert values.u.dtype == torch.uint8 and values.u.shape == (40, cols)
    assert int(values.u.max()) < 2 ** fmt.bits and values.s.shape == (40, cols // fmt.group)
    assert (values.m is not None) == fmt.has_mins
    assert torch.equal(values.dequantize(), torch.from_numpy(dequantize(raw, ggml_type)))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_module_rows_are_the_files_weights_bitwise(ggml_type):
    """Packed into tiles (fp16 scales where the file's are fp16) and read back: nothing moved,
    for all rows and for a scattered gather (a tied embedding's lookup)."""
    linear, blocks = _linear(ggml_type)
    expected = torch.from_numpy(dequantize(blocks.data.numpy(), ggml_type))
    assert torch.equal(linear.rows(torch.arange(40)), expected)
    ids = torch.tensor([39, 0, 17, 17, 5])
    assert torch.equal(linear.rows(ids), expected[ids])  # the C lookup where built
    assert torch.equal(linear.values(ids).dequantize(), expected[ids])  # the path without a C compiler
    # fp16 scales where the file's are fp16; a K type's factors (fp16 d, int8 sc) in a byte buffer
    assert linear.scales.dtype == (torch.float16 if BLOCK_FORMATS[ggml_type].half_scales else torch.uint8)
    for lookup in (linear.rows, linear.values):  # an id in the last tile's padding is still refused
        with pytest.raises(IndexError, match=r"\[0, 40\)"):
            lookup(torch.tensor([3, 40]))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_placed_linear_reads_one_signed_copy_with_the_files_bits(ggml_type, monkeypatch):
    """In a placed trunk (`device_kernels`; here VERISPEC_TRITON=0, the PyTorch statements) `.to()`
    leaves the packed blocks where they are, and the row gather and the matmul read one copy,
    w = u - z int8 with s (and m): gguf-py's rows and `reference_matmul`'s product, bitwise."""
    linear, blocks = _linear(ggml_type)
    expected_rows = torch.from_numpy(dequantize(blocks.data.numpy(), ggml_type))
    x = _x(5, 512)
    expected = reference_matmul(x, linear.values())
    monkeypatch.setenv("VERISPEC_TRITON", "0")
    linear.device_kernels = True
    packed = linear.packed
    linear.to("meta")  # what TrunkModule.to_device does to every module, after setting the switch
    assert linear.packed is packed
    ids = torch.tensor([39, 0, 17, 17, 5])
    assert torch.equal(linear.rows(ids), expected_rows[ids])
    assert torch.equal(linear(x), expected)
    w, _, m = linear._signed[1]
    assert w.dtype == torch.int8 and (m is not None) == BLOCK_FORMATS[ggml_type].has_mins
    assert linear._unpacked is None  # no second copy


def test_activations_are_quantised_per_32_as_llama_cpp_does():
    x = _x(3, 64)
    x[1, :32] = 0  # an all-zero block: scale 0, values 0
    a, d, S = quantize_activations(x)
    assert a.dtype == torch.int8 and d.shape == (3, 2) and S.shape == (3, 4)
    assert d[1, 0] == 0 and not a[1, :32].any()
    blocks = x.reshape(3, 2, 32)
    assert torch.equal(d, blocks.abs().amax(-1) / 127)
    assert (a.reshape(3, 2, 32).float() * d[..., None] - blocks).abs().max() <= d.max() / 2 + 1e-7
    assert torch.equal(S, a.reshape(3, 4, 16).int().sum(-1))
    assert int(a.abs().max()) == 127


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_product_is_the_dense_product_within_the_activation_rounding(ggml_type):
    """y - x·Wᵀ is the activations' rounding alone: |Σ w_i (x_i - a_i d)| <= Σ |w_i| d / 2 per
    block, plus fp32 accumulation (relative 1e-5 of Σ |w x|)."""
    linear, blocks = _linear(ggml_type, seed=1)
    w = torch.from_numpy(dequantize(blocks.data.numpy(), ggml_type)).double()
    x = _x(5, 512)
    _, d, _ = quantize_activations(x)
    bound = (w.abs().reshape(40, 16, 32).sum(-1) @ (d.double() / 2).t()).t()  # [5, 40]
    exact = x.double() @ w.t()
    slack = 1e-5 * (x.double().abs() @ w.abs().t())
    assert ((linear(x).double() - exact).abs() <= bound + slack).all()
    assert not torch.equal(linear(x).double(), exact)  # premise: the rounding is there


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_kernel_is_its_pytorch_statement_bitwise(ggml_type):
    linear, _ = _linear(ggml_type, seed=2)
    x = _x(70, 512)  # 70 rows: full units of 4 rows and a tail, as a prefill chunk has
    for n in (1, 2, 3, 5, 70):
        assert torch.equal(linear(x[:n]), reference_matmul(x[:n], linear.values())), n


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_kernel_is_exact_at_the_largest_integer_sums(ggml_type):
    """Every stored integer at its largest (packed bytes all 0xFF: u = 2^bits - 1) against
    activations all +127 or all -127 (a constant row): the largest sums any block can hold, where
    an integer path that adds products in narrower lanes (the AVX2 path's int16 sums) would overflow
    first. Still bitwise the PyTorch statement."""
    linear, _ = _linear(ggml_type, seed=6)
    linear.packed.fill_(0xFF)
    x = torch.cat([torch.full((3, 512), 0.5), torch.full((2, 512), -2.0)])
    a, _, _ = quantize_activations(x)
    assert a[:3].eq(127).all() and a[3:].eq(-127).all()  # premise
    for n in (1, 5):
        rows = x[:n] if n == 1 else x
        assert torch.equal(linear(rows), reference_matmul(rows, linear.values())), n
    assert linear.values().u.eq(2 ** BLOCK_FORMATS[ggml_type].bits - 1).all()  # premise: every u at its largest


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES)
def test_block_linears_are_batch_and_thread_invariant(ggml_type):
    """k = 2..9 rows in one call are bitwise the rows computed one at a time, at 1 and 2 threads."""
    linear, _ = _linear(ggml_type, rows=600, seed=3)  # 38 tiles: enough work for two threads
    x = _x(9, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i:i + 1]) for i in range(9)])
        torch.set_num_threads(2)
        for k in range(2, 10):
            assert torch.equal(linear(x[:k]), alone[:k]), f"k={k}"
    finally:
        torch.set_num_threads(threads)


def _cpu_has(*flags: str) -> bool:
    try:
        cpu = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return all(flag in cpu for flag in flags)


@needs_kernels
@pytest.mark.parametrize("flags, path", [(["-DVERISPEC_PORTABLE"], 0),
                                         pytest.param(["-march=x86-64-v3"], 1, marks=pytest.mark.skipif(
                                             not _cpu_has("avx2", "f16c", "fma"), reason="no AVX2 here")),
                                         pytest.param(["-DVERISPEC_NO_AMX"], 2, marks=pytest.mark.skipif(
                                             ckernels.library() is None or ckernels.library().verispec_qmatmul_path() != 3,
                                             reason="this machine's build does not run AMX"))],
                         ids=["portable", "avx2", "vnni"])
def test_every_path_of_the_kernel_gives_the_same_bits(tmp_path, monkeypatch, flags, path):
    """qmatmul.c built for another instruction set (the plain loop other CPUs run, AVX2 without
    AVX-512, AVX-512 VNNI without AMX's tile products) gives the same bits as this machine's build,
    for every format, at 1, 9 and 40 rows (40: runs of 16 rows through AMX where this machine has it),
    on random weights and on the largest integer sums (every u at its largest, activations ±127)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    other = ctypes.CDLL(str(ckernels.LIBRARY.build(extra_flags=flags)))
    assert other.verispec_qmatmul_path() == path
    for ggml_type, largest in itertools.product(TYPES, (False, True)):
        linear, _ = _linear(ggml_type, seed=4)
        if largest:  # as test_the_kernel_is_exact_at_the_largest_integer_sums
            linear.packed.fill_(0xFF)
        for n in (1, 9, 40):
            x = torch.full((n, 512), -2.0 if n == 9 else 0.5) if largest else _x(n, 512)
            y = torch.empty(n, 40)
            assert other.verispec_qmatmul(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(512),
                                          *[ctypes.c_void_p(a) if i < 3 else ctypes.c_int64(a)
                                            for i, a in enumerate(linear.kernel_args())],
                                          ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(1)) == 0
            assert torch.equal(y, linear(x)), (ggml_type.name, n, largest)


def test_without_the_kernels_the_reference_runs(monkeypatch):
    linear, _ = _linear(T.Q4_K, seed=5)
    x = _x(3, 512)
    monkeypatch.setattr(ckernels, "library", lambda: None)
    assert torch.equal(linear(x), reference_matmul(x, linear.values()))


def test_a_block_linear_is_never_built_from_float_weights():
    with pytest.raises(TypeError, match="from_gguf"):
        block_linear_class(T.Q8_0).from_float(torch.zeros(16, 32))
    with pytest.raises(ValueError, match=r"in_features % 32"):
        block_linear_class(T.Q8_0)(48, 16, device="meta")


def test_gguf_is_a_weight_mode():
    assert canonical_dtype("gguf") == "gguf" and rows_per_forward("gguf") == 64
    layer = swap_linears(nn.Sequential(nn.Linear(64, 16, bias=False, device="meta")), "gguf")
    assert isinstance(layer[0], GGUFLinear) and module_batch_invariant(layer)
    # built from float weights (no file blocks) it is the int8 class, as for an F32 tensor
    dense = swap_linears(nn.Sequential(nn.Linear(64, 16, bias=False)), "gguf")
    assert type(dense[0]) is Int8Linear


# --- through the loader ---------------------------------------------------------------

D, E = 256, 2  # Q4_K rows are 256 wide
TABLE = (
    Tensor("token_embd.weight", "embed.weight"),
    Tensor("q4_0.weight", "q4_0.weight"),
    Tensor("q4_1.weight", "q4_1.weight"),
    Tensor("q4_k.weight", "q4_k.weight"),
    Tensor("f32.weight", "f32.weight"),
    Tensor("gate_up.weight", "gate_up.weight", alternatives=(Stack("gate.weight", "up.weight"),)),
    Tensor("mixed.weight", "mixed.weight", alternatives=(Stack("mixed_a.weight", "mixed_b.weight"),)),
    Tensor("exps.weight", "experts.{e}.weight", per_expert=True),
)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        make = lambda rows: nn.Linear(D, rows, bias=False, device="meta")  # noqa: E731
        self.embed, self.q4_0, self.q4_1, self.q4_k, self.f32 = make(20), make(24), make(16), make(40), make(8)
        self.gate_up, self.mixed = make(32), make(32)
        self.experts = nn.ModuleList(make(16) for _ in range(E))
        swap_linears(self, "gguf")


def _fixture(tmp_path, extra=None):
    rng = np.random.default_rng(5)
    tensors = {"token_embd.weight": rng.standard_normal((20, D)), "q4_0.weight": random_blocks(T.Q4_0, 24, D),
               "q4_1.weight": random_blocks(T.Q4_1, 16, D, 1), "q4_k.weight": random_blocks(T.Q4_K, 40, D, 2),
               "f32.weight": rng.standard_normal((8, D)), "gate.weight": random_blocks(T.Q4_0, 16, D, 3),
               "up.weight": random_blocks(T.Q4_K, 16, D, 4), "mixed_a.weight": random_blocks(T.Q4_K, 16, D, 5),
               "mixed_b.weight": rng.standard_normal((16, D)),
               "exps.weight": random_blocks(T.Q4_1, E * 16, D, 6).reshape(E, 16, -1), **(extra or {})}
    types = {"token_embd.weight": "Q8_0", "q4_0.weight": "Q4_0", "q4_1.weight": "Q4_1",
             "q4_k.weight": "Q4_K", "gate.weight": "Q4_0", "up.weight": "Q4_K", "mixed_a.weight": "Q4_K",
             "exps.weight": "Q4_1"} | {name: "Q8_K" for name in extra or {}}
    path = write_gguf(tmp_path / "tiny.gguf", arch="tiny", metadata={}, tensors=tensors, vocab=None,
                      tensor_types=types)
    return GGUFFile.open(path)


def _stored(gguf, name, expert=None):
    raw, ggml_type, shape = gguf.raw_tensor(name)
    return GGUFBlocks(ggml_type, torch.from_numpy(np.array(raw if expert is None else raw[expert])), shape[-1])


def _load(gguf, **options):
    model = Tiny()
    plan_weights(gguf, model, TABLE, num_layers=0, num_experts=E).load(dtype="gguf", layout="tiny", **options)
    return model


def _file_weights(gguf, *names, expert=None):
    return torch.cat([torch.from_numpy(dequantize(_stored(gguf, n, expert).data.numpy(), _stored(gguf, n).ggml_type))
                      for n in names])


def test_the_loader_gives_each_linear_the_class_for_its_type_and_the_files_weights(tmp_path):
    gguf = _fixture(tmp_path)
    model = _load(gguf, use_cache=False)
    for name, ggml_type in (("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("q4_k", T.Q4_K), ("embed", T.Q8_0)):
        linear = getattr(model, name)
        assert type(linear) is block_linear_class(ggml_type), name
        assert torch.equal(linear.rows(torch.arange(linear.out_features)), _file_weights(gguf, f"{name}.weight"
                                                                                            if name != "embed"
                                                                                            else "token_embd.weight"))
    for e, linear in enumerate(model.experts):  # an expert's slice of a 3-D Q4_1 tensor
        assert type(linear) is block_linear_class(T.Q4_1)
        assert torch.equal(linear.rows(torch.arange(16)), _file_weights(gguf, "exps.weight", expert=e))
    assert type(model.f32) is Int8Linear  # F32: requantised int8
    assert torch.equal(model.f32.weight, Int8Linear.from_float(gguf.tensor("f32.weight")).weight)
    # parts of different types run partwise, each exact: Q4_0 | Q4_K, and Q4_K | F32 (int8)
    assert [type(m) for m in model.gate_up] == [block_linear_class(T.Q4_0), block_linear_class(T.Q4_K)]
    assert torch.equal(torch.cat([m.rows(torch.arange(16)) for m in model.gate_up]),
                       _file_weights(gguf, "gate.weight", "up.weight"))
    assert type(model.mixed) is PartwiseLinear
    assert [type(m) for m in model.mixed] == [block_linear_class(T.Q4_K), Int8Linear]
    assert torch.equal(model.mixed[0].rows(torch.arange(16)), _file_weights(gguf, "mixed_a.weight"))
    assert torch.equal(model.mixed[1].weight, Int8Linear.from_float(gguf.tensor("mixed_b.weight")).weight)
    assert module_batch_invariant(model)


def test_the_gguf_state_goes_through_the_weight_cache_under_its_own_key(tmp_path, monkeypatch):
    from verispec.checkpoints import cache_dir
    from verispec.gguf.load import WeightPlan

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", 0.0)
    gguf = _fixture(tmp_path)
    first = _load(gguf).state_dict()
    assert len(list(cache_dir("weights").glob("tiny-gguf-*.pt"))) == 1

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(WeightPlan, "convert", no_convert)
    second = _load(gguf).state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_type_with_no_mapping_is_refused_naming_tensor_and_fix(tmp_path):
    q8_k = np.random.default_rng(0).integers(0, 256, (40, D // 256 * GGML_QUANT_SIZES[T.Q8_K][1]), dtype=np.uint8)
    gguf = _fixture(tmp_path, extra={"q4_k.weight": q8_k})  # Q8_K: llama.cpp's dot-product scratch type
    with pytest.raises(UnmappedGGUFType, match=r"q4_k\.weight is stored as Q8_K.*re-quantise the file"):
        plan_weights(gguf, Tiny(), TABLE, num_layers=0, num_experts=E)


# --- stacked parts: fused when one class, partwise when mixed ----------------------------

class Attention(nn.Module):
    """q|k|v stacked in one linear with unequal parts, declared by the owning module."""

    def __init__(self, rows=(32, 16, 16)):
        super().__init__()
        self.part_rows = {"qkv": rows}
        self.qkv = nn.Linear(D, sum(rows), bias=False, device="meta")
        swap_linears(self, "gguf")


QKV_TABLE = (Tensor(Stack("q.weight", "k.weight", "v.weight"), "qkv.weight"),)


def _qkv_fixture(tmp_path, types, rows=(32, 16, 16)):
    tensors = {f"{p}.weight": random_blocks(T[t], r, D, seed) if t != "F32"
               else np.random.default_rng(seed).standard_normal((r, D))
               for seed, (p, t, r) in enumerate(zip("qkv", types, rows))}
    path = write_gguf(tmp_path / "qkv.gguf", arch="tiny", metadata={}, tensors=tensors, vocab=None,
                      tensor_types={f"{p}.weight": t for p, t in zip("qkv", types) if t != "F32"})
    return GGUFFile.open(path)


def _parts_alone(gguf, names):
    """Each part read as its own linear of its own class (what an unfused model would hold)."""
    out = []
    for name in names:
        raw, ggml_type, _ = gguf.raw_tensor(name)
        out.append(block_linear_class(ggml_type).from_gguf([_stored(gguf, name)]) if ggml_type in BLOCK_FORMATS
                   else Int8Linear.from_float(gguf.tensor(name)))
    return out


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_K"), ("Q5_0", "Q5_0", "Q5_0"), ("F32", "F32", "F32")])
def test_a_stack_of_one_class_is_one_linear_bitwise_its_parts_concatenated(tmp_path, types):
    gguf = _qkv_fixture(tmp_path, types)
    model = Attention()
    plan_weights(gguf, model, QKV_TABLE, num_layers=0).load(dtype="gguf", layout="qkv", use_cache=False)
    assert type(model.qkv) is (Int8Linear if types[0] == "F32" else block_linear_class(T[types[0]]))
    alone = _parts_alone(gguf, ["q.weight", "k.weight", "v.weight"])
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 5, 9):
        assert torch.equal(model.qkv(x[:n]), torch.cat([m(x[:n]) for m in alone], dim=-1)), n


def test_a_stack_of_mixed_classes_runs_each_part_in_its_own_class(tmp_path):
    """A Q4_K_M file's Q4_K attn_q/attn_k beside a Q6_K attn_v: the Q4_K run is one linear
    for both parts, the Q6_K part its own; nothing is requantised."""
    gguf = _qkv_fixture(tmp_path, ("Q4_K", "Q4_K", "Q6_K"))
    model = Attention()
    plan = plan_weights(gguf, model, QKV_TABLE, num_layers=0)
    assert plan.unused_tensors() == []
    plan.load(dtype="gguf", layout="qkv", use_cache=False)
    assert type(model.qkv) is PartwiseLinear
    assert [type(m) for m in model.qkv] == [block_linear_class(T.Q4_K), block_linear_class(T.Q6_K)]
    assert [m.out_features for m in model.qkv] == [48, 16] and model.qkv.out_features == 64
    assert module_batch_invariant(model)
    alone = _parts_alone(gguf, ["q.weight", "k.weight", "v.weight"])
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(0))
    expected = torch.cat([m(x) for m in alone], dim=-1)
    for n in range(1, 10):
        assert torch.equal(model.qkv(x[:n]), expected[:n]), n


def test_a_stacked_part_of_the_wrong_shape_is_named(tmp_path):
    from verispec.gguf.io import BadTensorShape

    gguf = _qkv_fixture(tmp_path, ("Q4_K", "Q4_K", "Q4_K"), rows=(32, 16, 32))  # v has 32 rows, not 16
    with pytest.raises(BadTensorShape, match=r"v\.weight"):
        plan_weights(gguf, Attention(), QKV_TABLE, num_layers=0).check()
    with pytest.raises(ValueError, match=r"declares as \(32, 16\)"):  # a declaration that does not fit
        plan_weights(gguf, Attention(rows=(32, 16)), QKV_TABLE, num_layers=0)


def test_without_the_kernels_the_default_falls_back_to_int8(monkeypatch):
    """gguf's PyTorch path gives the kernel's bits ~20x slower, so a family that prefers gguf
    defaults to int8 where the C kernels are not built; other preferences are kept."""
    from verispec.weights.gguf_mode import default_dtype

    monkeypatch.setattr(ckernels, "library", lambda: None)
    assert default_dtype("gguf") == "int8" and default_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(ckernels, "library", lambda: object())
    assert default_dtype("gguf") == "gguf"


# --- a draft head's finite check on the kept-packed path -------------------------------

@pytest.mark.parametrize("ggml_type, offset, value, counts", [
    (T.Q8_0, 0, np.inf, "1 inf of"),  # d, the block's scale
    (T.Q8_0, 0, np.nan, "1 NaN of"),
    (T.Q4_1, 2, np.nan, "1 NaN of"),  # m, the block's min
    (T.Q4_K, 0, np.nan, "NaN of"),  # d, the super-block's factor (kept as bytes: checked unpacked)
], ids=["Q8_0-d-inf", "Q8_0-d-nan", "Q4_1-m-nan", "Q4_K-d-nan"])
def test_a_non_finite_block_scale_is_refused_naming_the_tensor(tmp_path, ggml_type, offset, value, counts):
    """finite=True on a block linear: its scales and mins are checked as they are kept, packed
    (no dequantised copy of the weight is made), and a NaN or an infinity names the GGUF tensor."""
    from verispec.errors import DamagedFile

    raw = random_blocks(ggml_type, 16, D, seed=7)
    raw[3, offset:offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)  # row 3's first block
    path = write_gguf(tmp_path / "head.gguf", arch="tiny", metadata={}, tensors={"proj.weight": raw}, vocab=None,
                      tensor_types={"proj.weight": ggml_type.name})
    model = swap_linears(nn.Sequential(nn.Linear(D, 16, bias=False, device="meta")), "gguf")
    plan = plan_weights(GGUFFile.open(path), model, (Tensor("proj.weight", "0.weight"),), num_layers=0)
    assert type(plan.convert(progress=False)["0.packed"]) is torch.Tensor  # unchecked, the same file loads
    with pytest.raises(DamagedFile) as info:
        plan.convert(progress=False, finite=True)
    message = str(info.value)
    assert message.startswith(f"{path}: tensor 'proj.weight' holds ") and counts in message, message
    assert "block scales" in message and "\n" not in message
