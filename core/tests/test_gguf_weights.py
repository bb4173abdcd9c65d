"""The `gguf` weight mode: a GGUF's Q4_0/Q4_1/Q4_K blocks reach the int4 kernel unrequantised
(nn.gguf_blocks, nn.quant.GGUFInt4Linear), other types go to int8; checked against
`gguf.quants.dequantize` on random stored blocks (every bit pattern of the packed scales),
through the loader and the weight cache, and for batch invariance."""
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize
from torch import nn

from verispec import weight_cache
from verispec.gguf_io import GGUFFile
from verispec.gguf_load import Stack, Tensor, plan_weights
from verispec.nn.gguf_blocks import GROUP, INT4_TYPES, GGUFBlocks, unpack_int4
from verispec.nn.quant import (
    GGUFInt4Linear,
    GGUFLinear,
    Int8Linear,
    PartwiseLinear,
    UnmappedGGUFType,
    canonical_dtype,
    module_batch_invariant,
    rows_per_forward,
    swap_linears,
)
from verispec.testing.fixture_writer import write_gguf
from verispec.testing.gguf_weights import assert_within_scale_rounding


def random_blocks(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random stored blocks, every fp16 field (d, m, dmin) a finite
    value of either sign around 1e-3 (a real checkpoint's range), every other byte random."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    num_f16 = 1 if ggml_type == T.Q4_0 else 2
    f16 = (rng.standard_normal((rows, cols // block_size, num_f16)) * 1e-3).astype(np.float16)
    raw[..., :2 * num_f16] = f16.view(np.uint8)
    return raw.reshape(rows, -1)


def _blocks(ggml_type, raw, cols):
    return GGUFBlocks(ggml_type, torch.from_numpy(raw.copy()), cols)


def _expand(groups):
    return groups.repeat_interleave(GROUP, dim=1)


@pytest.mark.parametrize("ggml_type", sorted(INT4_TYPES))
def test_unpacked_groups_are_the_files_weights(ggml_type):
    """(q - 8) · scale + zero in fp32 is gguf-py's dequantisation: bitwise for Q4_0 (d·(q-8) is
    exact), and within one fp32 rounding of the zero for Q4_1/Q4_K, whose zero m + 8d /
    8·d·sc - dmin·m sums two independent random fp16 terms here (bitwise on the real files)."""
    cols = 512
    raw = random_blocks(ggml_type, 40, cols)
    q, scale, zero = unpack_int4(_blocks(ggml_type, raw, cols))
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == zero.shape == (40, cols // GROUP)
    ours = (q.float() - 8) * _expand(scale) + _expand(zero)
    expected = torch.from_numpy(dequantize(raw, ggml_type))
    if ggml_type == T.Q4_0:
        assert torch.equal(ours, expected)
    bound = torch.finfo(torch.float32).eps * (_expand(zero).abs() + expected.abs())
    assert ((ours - expected).abs() <= bound).all()


@pytest.mark.parametrize("ggml_type", sorted(INT4_TYPES))
def test_module_weights_are_the_file_within_the_bf16_scale_rounding(ggml_type):
    """The kernel needs bf16 scales and zeros: each weight moves by at most half a bf16 ulp of
    its scale times |q - 8| plus half a bf16 ulp of its zero (and one fp32 rounding); the
    4-bit values are the file's. The kernel itself dequantises exactly what `rows` returns:
    one-hot rows through `forward` give `rows`, rounded to the bf16 output."""
    rows, cols = 40, 512  # 40 rows: padded to 48 for the kernel
    raw = random_blocks(ggml_type, rows, cols, seed=1)
    linear = GGUFInt4Linear.from_gguf([_blocks(ggml_type, raw, cols)])
    weights = linear.rows(torch.arange(rows))
    assert_within_scale_rounding(weights, [_blocks(ggml_type, raw, cols)])
    assert not torch.equal(weights, torch.from_numpy(dequantize(raw, ggml_type)))  # premise: bf16 moves them
    one_hot = linear(torch.eye(cols))  # [cols, rows] = W^T through the kernel
    assert torch.equal(one_hot.t(), weights.bfloat16().float())


@pytest.mark.parametrize("cls", [GGUFInt4Linear, Int8Linear])
def test_the_modes_classes_are_batch_invariant(cls):
    """k = 2..9 rows in one call are bitwise the rows computed one at a time."""
    rows, cols = 48, 768
    raw = random_blocks(T.Q4_K, rows, cols, seed=2)
    blocks = _blocks(T.Q4_K, raw, cols)
    linear = cls.from_gguf([blocks]) if cls is GGUFInt4Linear else cls.from_float(
        torch.from_numpy(dequantize(raw, T.Q4_K)))
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(9)])
    for k in range(2, 10):
        assert torch.equal(linear(x[:k]), alone[:k]), f"k={k}"


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
    types = {"token_embd.weight": "Q8_0", "mixed_b.weight": "Q8_0", "q4_0.weight": "Q4_0", "q4_1.weight": "Q4_1",
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


def test_the_loader_gives_each_linear_the_class_for_its_type_and_the_files_weights(tmp_path):
    gguf = _fixture(tmp_path)
    model = _load(gguf, use_cache=False)
    int4 = {"q4_0": ["q4_0.weight"], "q4_1": ["q4_1.weight"], "q4_k": ["q4_k.weight"],
            "gate_up": ["gate.weight", "up.weight"]}  # a stack of Q4_0 and Q4_K parts stays exact
    for name, parts in int4.items():
        linear = getattr(model, name)
        assert type(linear) is GGUFInt4Linear, name
        blocks = [_stored(gguf, p) for p in parts]
        assert_within_scale_rounding(linear.rows(torch.arange(linear.out_features)), blocks)
    for e, linear in enumerate(model.experts):  # an expert's slice of a 3-D Q4_1 tensor
        assert type(linear) is GGUFInt4Linear
        assert_within_scale_rounding(linear.rows(torch.arange(16)), [_stored(gguf, "exps.weight", e)])
    for name in ("embed", "f32"):  # Q8_0, F32: requantised int8
        assert type(getattr(model, name)) is Int8Linear, name
    assert torch.equal(model.embed.weight, Int8Linear.from_float(gguf.tensor("token_embd.weight")).weight)
    # Q4_K stacked with Q8_0: never one requantised int8 linear, each part keeps its own class
    assert type(model.mixed) is PartwiseLinear
    assert [type(m) for m in model.mixed] == [GGUFInt4Linear, Int8Linear]
    assert_within_scale_rounding(model.mixed[0].rows(torch.arange(16)), [_stored(gguf, "mixed_a.weight")])
    assert torch.equal(model.mixed[1].weight, Int8Linear.from_float(gguf.tensor("mixed_b.weight")).weight)
    assert module_batch_invariant(model)


def test_the_gguf_state_goes_through_the_weight_cache_under_its_own_key(tmp_path, monkeypatch):
    from verispec.checkpoints import cache_dir
    from verispec.gguf_load import WeightPlan

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
    tensors = {f"{p}.weight": random_blocks(T[t], r, D, seed) if t.startswith("Q4")
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
        out.append(GGUFInt4Linear.from_gguf([_stored(gguf, name)]) if ggml_type in INT4_TYPES
                   else Int8Linear.from_float(gguf.tensor(name)))
    return out


@pytest.mark.parametrize("types", [("Q4_K", "Q4_0", "Q4_1"), ("Q8_0", "F32", "Q8_0")])
def test_a_stack_of_one_class_is_one_linear_bitwise_its_parts_concatenated(tmp_path, types):
    gguf = _qkv_fixture(tmp_path, types)
    model = Attention()
    plan_weights(gguf, model, QKV_TABLE, num_layers=0).load(dtype="gguf", layout="qkv", use_cache=False)
    assert type(model.qkv) is (GGUFInt4Linear if types[0].startswith("Q4") else Int8Linear)
    alone = _parts_alone(gguf, ["q.weight", "k.weight", "v.weight"])
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 5, 9):
        assert torch.equal(model.qkv(x[:n]), torch.cat([m(x[:n]) for m in alone], dim=-1)), n


def test_a_stack_of_mixed_classes_runs_each_part_in_its_own_class(tmp_path):
    """A Q4_K_M file's Q4_K attn_q/attn_k beside a Q6_K-like attn_v: the Q4 run stays exact int4
    (one linear for both), the other part int8; nothing requantises the Q4 parts."""
    gguf = _qkv_fixture(tmp_path, ("Q4_K", "Q4_0", "Q8_0"))
    model = Attention()
    plan = plan_weights(gguf, model, QKV_TABLE, num_layers=0)
    assert plan.unused_tensors() == []
    plan.load(dtype="gguf", layout="qkv", use_cache=False)
    assert type(model.qkv) is PartwiseLinear and [type(m) for m in model.qkv] == [GGUFInt4Linear, Int8Linear]
    assert [m.out_features for m in model.qkv] == [48, 16] and model.qkv.out_features == 64
    assert module_batch_invariant(model)
    alone = _parts_alone(gguf, ["q.weight", "k.weight", "v.weight"])
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(0))
    expected = torch.cat([m(x) for m in alone], dim=-1)
    for n in range(1, 10):
        assert torch.equal(model.qkv(x[:n]), expected[:n]), n


def test_a_stacked_part_of_the_wrong_shape_is_named(tmp_path):
    from verispec.gguf_io import BadTensorShape

    gguf = _qkv_fixture(tmp_path, ("Q4_K", "Q4_0", "Q4_1"), rows=(32, 16, 32))  # v has 32 rows, not 16
    with pytest.raises(BadTensorShape, match=r"v\.weight"):
        plan_weights(gguf, Attention(), QKV_TABLE, num_layers=0).check()
    with pytest.raises(ValueError, match=r"declares as \(32, 16\)"):  # a declaration that does not fit
        plan_weights(gguf, Attention(rows=(32, 16)), QKV_TABLE, num_layers=0)
