"""verispec.gguf.load: a typed tensor table driving GGUF -> module state, on tiny fixture files
(expansion per layer and expert, optional entries, alternatives, stacks, dtypes, errors, cache)."""
import re

import pytest
import torch
from torch import nn

from verispec import weight_cache
from verispec.errors import DamagedFile
from verispec.gguf.io import BadTensorShape, GGUFFile, MissingTensor
from verispec.gguf.checks import check_finite, check_numbers
from verispec.gguf.load import UnmappedParameter, plan_weights
from verispec.gguf.table import Stack, Tensor, TensorSource, expand_table
from verispec.nn.norm import RMSNorm
from verispec.weights.quant import Int8Linear, swap_linears
from verispec.testing.fixture_writer import write_gguf

# hidden, q rows, gate and up rows each, experts, layers, vocab
D, Q, F, E, L, V = 8, 12, 5, 3, 2, 11

TABLE = (
    Tensor("token_embd.weight", "embed.weight"),
    Tensor("blk.{i}.norm.weight", "layers.{i}.norm.weight"),
    Tensor("blk.{i}.attn_q.weight", "layers.{i}.q.weight"),
    Tensor("blk.{i}.attn_q.bias", "layers.{i}.q_bias"),
    Tensor("blk.{i}.scale", "layers.{i}.scale", optional=True),
    Tensor("blk.{i}.gate_up.weight", "layers.{i}.gate_up.weight",
           alternatives=(Stack("blk.{i}.gate.weight", "blk.{i}.up.weight"),)),
    Tensor("blk.{i}.exps_gate_up.weight", "layers.{i}.experts.{e}.weight", per_expert=True,
           alternatives=(Stack("blk.{i}.exps_gate.weight", "blk.{i}.exps_up.weight"),)),
)


class TinyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(D)
        self.q = nn.Linear(D, Q, bias=False, device="meta")
        self.q_bias = nn.Parameter(torch.zeros(Q), requires_grad=False)
        self.register_buffer("scale", torch.full((1,), 1.0))
        self.gate_up = nn.Linear(D, 2 * F, bias=False, device="meta")
        self.experts = nn.ModuleList(nn.Linear(D, 2 * F, bias=False, device="meta") for _ in range(E))


class Tiny(nn.Module):
    def __init__(self, dtype="float32"):
        super().__init__()
        self.embed = nn.Linear(D, V, bias=False, device="meta")
        self.layers = nn.ModuleList(TinyLayer() for _ in range(L))
        swap_linears(self, dtype)


def _tensors(*, fused=True, scale=True, seed=0):
    """GGUF name -> torch-order tensor for TABLE; fused or split gate/up, with or without scales."""
    g = torch.Generator().manual_seed(seed)
    out = {"token_embd.weight": torch.randn(V, D, generator=g)}
    for i in range(L):
        out |= {f"blk.{i}.norm.weight": torch.randn(D, generator=g),
                f"blk.{i}.attn_q.weight": torch.randn(Q, D, generator=g),
                f"blk.{i}.attn_q.bias": torch.randn(Q, generator=g)}
        if scale:
            out[f"blk.{i}.scale"] = torch.randn(1, generator=g)
        gate_up, experts = torch.randn(2 * F, D, generator=g), torch.randn(E, 2 * F, D, generator=g)
        if fused:
            out |= {f"blk.{i}.gate_up.weight": gate_up, f"blk.{i}.exps_gate_up.weight": experts}
        else:
            out |= {f"blk.{i}.gate.weight": gate_up[:F], f"blk.{i}.up.weight": gate_up[F:],
                    f"blk.{i}.exps_gate.weight": experts[:, :F], f"blk.{i}.exps_up.weight": experts[:, F:]}
    return out


def _file(tmp_path, tensors, name="tiny.gguf"):
    return GGUFFile.open(write_gguf(tmp_path / name, arch="tiny", metadata={}, tensors=tensors, vocab=None))


def _load(gguf, dtype="float32", **options):
    model = Tiny(dtype)
    plan_weights(gguf, model, TABLE, num_layers=L, num_experts=E).load(dtype=dtype, layout="tiny", **options)
    return model


def test_expansion_per_layer_and_expert():
    names = expand_table(TABLE, num_layers=L, num_experts=E)
    assert len(names) == 1 + L * (5 + E)
    assert names["embed.weight"] == TensorSource((("token_embd.weight",),))
    assert names["layers.1.q.weight"] == TensorSource((("blk.1.attn_q.weight",),))
    assert names["layers.0.scale"] == TensorSource((("blk.0.scale",),), optional=True)
    assert names["layers.1.gate_up.weight"].alternatives == (("blk.1.gate_up.weight",),
                                                             ("blk.1.gate.weight", "blk.1.up.weight"))
    assert names["layers.1.experts.2.weight"] == TensorSource(
        (("blk.1.exps_gate_up.weight",), ("blk.1.exps_gate.weight", "blk.1.exps_up.weight")), expert=2)
    assert "layers.2.q.weight" not in names and "layers.0.experts.3.weight" not in names
    with pytest.raises(ValueError, match="layers.0.q.weight"):
        expand_table([*TABLE, Tensor("blk.{i}.other.weight", "layers.{i}.q.weight")], num_layers=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"source": "blk.{i}.x", "state_name": "x"}, "{i}"),
    ({"source": "blk.0.x", "state_name": "layers.{i}.x"}, "{i}"),
    ({"source": Stack("blk.{i}.a", "b"), "state_name": "layers.{i}.x"}, "{i}"),
    ({"source": "x", "state_name": "experts.{e}.x"}, "per_expert"),
    ({"source": "x", "state_name": "experts.x", "per_expert": True}, "per_expert"),
    ({"source": "blk.{j}.x", "state_name": "x"}, "only the fields"),
])
def test_malformed_entries_are_refused_when_the_table_is_written(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tensor(**kwargs)
    with pytest.raises(TypeError):
        Stack("only-one")
    with pytest.raises(TypeError):
        Tensor(3, "x")


@pytest.mark.parametrize("fused", [True, False])
def test_fp32_state_is_the_file_with_stacks_expert_slices_and_alternatives(tmp_path, fused):
    tensors = _tensors(fused=fused)
    gguf = _file(tmp_path, tensors)
    model = _load(gguf)
    state = model.state_dict()
    assert torch.equal(state["embed.weight"], tensors["token_embd.weight"])
    for i in range(L):
        assert torch.equal(state[f"layers.{i}.norm.weight"], tensors[f"blk.{i}.norm.weight"])
        assert torch.equal(state[f"layers.{i}.q.weight"], tensors[f"blk.{i}.attn_q.weight"])
        assert torch.equal(state[f"layers.{i}.q_bias"], tensors[f"blk.{i}.attn_q.bias"])
        assert torch.equal(state[f"layers.{i}.scale"], tensors[f"blk.{i}.scale"])
        if fused:
            gate_up, experts = tensors[f"blk.{i}.gate_up.weight"], tensors[f"blk.{i}.exps_gate_up.weight"]
        else:
            gate_up = torch.cat([tensors[f"blk.{i}.gate.weight"], tensors[f"blk.{i}.up.weight"]])
            experts = torch.cat([tensors[f"blk.{i}.exps_gate.weight"], tensors[f"blk.{i}.exps_up.weight"]],
                                dim=1)
        assert torch.equal(state[f"layers.{i}.gate_up.weight"], gate_up)
        for e in range(E):
            assert torch.equal(state[f"layers.{i}.experts.{e}.weight"], experts[e])
    assert all(v.dtype == torch.float32 for v in state.values())
    assert not model.training
    plan = plan_weights(gguf, Tiny(), TABLE, num_layers=L, num_experts=E)
    assert plan.gguf_names == set(tensors)  # the chosen alternative's names only


def test_the_first_present_alternative_wins(tmp_path):
    both = {**_tensors(fused=True), **_tensors(fused=False, seed=1)}
    gguf = _file(tmp_path, both)
    state = _load(gguf).state_dict()
    assert torch.equal(state["layers.0.gate_up.weight"], both["blk.0.gate_up.weight"])
    assert torch.equal(state["layers.1.experts.2.weight"], both["blk.1.exps_gate_up.weight"][2])
    plan = plan_weights(gguf, Tiny(), TABLE, num_layers=L, num_experts=E)
    assert "blk.0.gate.weight" not in plan.gguf_names
    unused = plan.unused_tensors()  # the losing alternative's tensors: a family would refuse the file
    assert unused == sorted(set(both) - set(_tensors(fused=True))) and "blk.0.gate.weight" in unused
    assert plan.unused_tensors(read_elsewhere=unused) == []


def test_an_absent_optional_entry_keeps_the_module_default(tmp_path):
    gguf = _file(tmp_path, _tensors(scale=False))
    plan = plan_weights(gguf, Tiny(), TABLE, num_layers=L, num_experts=E)
    assert not any("scale" in name for name in plan.gguf_names)
    state = _load(gguf).state_dict()
    assert [state[f"layers.{i}.scale"].tolist() for i in range(L)] == [[1.0]] * L


def test_linears_take_their_module_dtype_and_everything_else_stays_fp32(tmp_path):
    tensors = _tensors()
    model = _load(_file(tmp_path, tensors), "int8")
    q = model.layers[1].q
    assert isinstance(q, Int8Linear)
    expected = Int8Linear.from_float(tensors["blk.1.attn_q.weight"]).state_dict()
    assert set(expected) == {"weight", "scales"}
    for key, value in expected.items():
        assert torch.equal(getattr(q, key), value) and getattr(q, key).dtype == value.dtype
    expert = Int8Linear.from_float(tensors["blk.0.exps_gate_up.weight"][1])
    assert torch.equal(model.layers[0].experts[1].weight, expert.weight)
    layer = model.layers[0]
    assert [t.dtype for t in (layer.norm.weight, layer.q_bias, layer.scale)] == [torch.float32] * 3
    assert torch.equal(layer.norm.weight, tensors["blk.0.norm.weight"])


def test_a_missing_required_tensor_is_named_with_architecture_and_file(tmp_path):
    tensors = _tensors()
    del tensors["blk.1.attn_q.weight"]
    gguf = _file(tmp_path, tensors)
    plan = plan_weights(gguf, Tiny(), TABLE, num_layers=L, num_experts=E)  # planning reads nothing
    assert "blk.1.attn_q.weight" in plan.gguf_names
    with pytest.raises(MissingTensor) as e:
        plan.load(dtype="float32", layout="tiny", use_cache=False)
    assert (e.value.name, e.value.arch, e.value.path) == ("blk.1.attn_q.weight", "tiny", gguf.path)
    assert "blk.1.attn_q.weight" in str(e.value) and gguf.path in str(e.value)


def test_with_no_alternative_present_the_first_source_is_named(tmp_path):
    tensors = _tensors(fused=False)
    del tensors["blk.0.exps_up.weight"]  # the split pair is incomplete, the fused tensor absent
    with pytest.raises(MissingTensor, match="blk.0.exps_gate_up.weight"):
        _load(_file(tmp_path, tensors), use_cache=False)


@pytest.mark.parametrize("name, bad", [
    ("blk.0.attn_q.weight", torch.zeros(Q - 1, D)),
    ("blk.1.norm.weight", torch.zeros(D + 1)),
    ("blk.1.scale", torch.zeros(2)),  # an optional entry, when present, is checked too
    ("blk.0.exps_gate_up.weight", torch.zeros(E - 1, 2 * F, D)),  # one expert short
])
def test_a_shape_mismatch_is_refused_naming_the_tensor(tmp_path, name, bad):
    with pytest.raises(BadTensorShape) as e:
        _load(_file(tmp_path, {**_tensors(), name: bad}), use_cache=False)
    assert e.value.name == name and e.value.got == tuple(bad.shape)


def test_split_parts_are_shape_checked(tmp_path):
    tensors = _tensors(fused=False)
    tensors["blk.1.up.weight"] = torch.zeros(F + 1, D)
    with pytest.raises(BadTensorShape, match="blk.1.up.weight"):
        _load(_file(tmp_path, tensors), use_cache=False)


def test_table_bugs_are_refused_by_name(tmp_path):
    gguf = _file(tmp_path, _tensors(scale=False))
    with pytest.raises(UnmappedParameter, match="layers.0.q_bias"):
        plan_weights(gguf, Tiny(), [t for t in TABLE if t.state_name != "layers.{i}.q_bias"], num_layers=L,
                     num_experts=E)
    optional_linear = [Tensor(t.source, t.state_name, optional=True) if t.state_name == "layers.{i}.q.weight" else t
                       for t in TABLE]
    no_q = _file(tmp_path, {k: v for k, v in _tensors().items() if "attn_q.weight" not in k}, "no_q.gguf")
    with pytest.raises(ValueError, match="no default"):
        plan_weights(no_q, Tiny(), optional_linear, num_layers=L, num_experts=E)


def test_the_converted_state_goes_through_the_weight_cache(tmp_path, monkeypatch):
    from verispec.checkpoints import cache_dir
    from verispec.gguf.load import WeightPlan

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", 0.0)
    gguf = _file(tmp_path, _tensors())
    first = _load(gguf, "int8").state_dict()
    assert len(list(cache_dir("weights").glob("tiny-int8-*.pt"))) == 1

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(WeightPlan, "convert", no_convert)
    second = _load(gguf, "int8").state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(AssertionError, match="converted again"):
        _load(gguf, "int8", use_cache=False)



class QKV(nn.Module):
    """q|k|v and their biases stacked with unequal rows, declared by the owning module."""

    ROWS = (12, 4, 4)

    def __init__(self, dtype="float32"):
        super().__init__()
        self.part_rows = {"qkv": self.ROWS, "qkv_bias": self.ROWS}
        self.qkv = nn.Linear(D, sum(self.ROWS), bias=False, device="meta")
        self.qkv_bias = nn.Parameter(torch.zeros(sum(self.ROWS)), requires_grad=False)
        swap_linears(self, dtype)


QKV_TABLE = (Tensor(Stack("q.weight", "k.weight", "v.weight"), "qkv.weight"),
             Tensor(Stack("q.bias", "k.bias", "v.bias"), "qkv_bias"))


def _qkv_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"{p}.{kind}": torch.randn(*((rows, D) if kind == "weight" else (rows,)), generator=g)
            for p, rows in zip("qkv", QKV.ROWS) for kind in ("weight", "bias")}


def test_a_stack_of_unequal_parts_takes_the_rows_its_module_declares(tmp_path):
    tensors = _qkv_tensors()
    model = QKV()
    plan_weights(_file(tmp_path, tensors), model, QKV_TABLE, num_layers=0).load(dtype="float32", layout="qkv",
                                                                               use_cache=False)
    assert torch.equal(model.qkv.weight, torch.cat([tensors[f"{p}.weight"] for p in "qkv"]))
    assert torch.equal(model.qkv_bias, torch.cat([tensors[f"{p}.bias"] for p in "qkv"]))


@pytest.mark.parametrize("name, bad", [
    ("k.weight", torch.zeros(5, D)),  # rows: q 12 + k 5 + v 4 would be 21, not 20
    ("v.weight", torch.zeros(4, D + 1)),  # columns
    ("q.bias", torch.zeros(11)),
])
def test_a_stack_part_of_the_wrong_shape_is_named(tmp_path, name, bad):
    with pytest.raises(BadTensorShape) as e:
        plan_weights(_file(tmp_path, {**_qkv_tensors(), name: bad}), QKV(), QKV_TABLE, num_layers=0).check()
    assert e.value.name == name and e.value.got == tuple(bad.shape)


def test_a_cached_state_of_another_module_layout_is_never_read(tmp_path, monkeypatch):
    """The weight-cache key holds the module's state layout: a state saved for separate linears
    (before q|k|v were fused) is not read into the fused module, which converts its own."""
    from verispec.checkpoints import cache_dir

    class Separate(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(D, rows, bias=False, device="meta") for rows in QKV.ROWS)
            self.qkv_bias = nn.Parameter(torch.zeros(sum(QKV.ROWS)), requires_grad=False)
            self.part_rows = {"qkv_bias": QKV.ROWS}
            swap_linears(self, "int8")

    separate_table = (*(Tensor(f"{p}.weight", f"{p}.weight") for p in "qkv"), QKV_TABLE[1])
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", 0.0)
    gguf = _file(tmp_path, _qkv_tensors())
    plan_weights(gguf, Separate(), separate_table, num_layers=0).load(dtype="int8", layout="qkv")
    fused = QKV("int8")
    plan_weights(gguf, fused, QKV_TABLE, num_layers=0).load(dtype="int8", layout="qkv")  # same tag
    assert len(list(cache_dir("weights").glob("tiny-int8-*.pt"))) == 2
    assert torch.equal(fused.qkv.weight, Int8Linear.from_float(torch.cat(
        [_qkv_tensors()[f"{p}.weight"] for p in "qkv"])).weight)


def _numbers_file(tmp_path, metadata=None, tensors=None):
    """A two-block "toyarch" file: token_embd [V, D], blk.{0,1}.attn_q [Q, D], sizes that match;
    `metadata` adds or overrides keys (None: leaves the key out)."""
    base = {"toyarch.block_count": 2, "toyarch.embedding_length": D, "toyarch.attention.head_count": 3,
            "toyarch.attention.key_length": 4, "toyarch.context_length": 64, "toyarch.attention.sliding_window": 16,
            "toyarch.rope.freq_base": 10000.0, "toyarch.attention.layer_norm_rms_epsilon": 1e-6}
    weights = {"token_embd.weight": torch.ones(V, D), "blk.0.attn_q.weight": torch.ones(Q, D),
               "blk.1.attn_q.weight": torch.ones(Q, D)}
    merged = {k: v for k, v in {**base, **(metadata or {})}.items() if v is not None}
    path = write_gguf(tmp_path / "numbers.gguf", arch="toyarch", metadata=merged,
                      tensors={**weights, **(tensors or {})}, vocab=None)
    return GGUFFile.open(path)


def test_sizes_the_tensors_back_pass(tmp_path):
    check_numbers(_numbers_file(tmp_path))
    check_finite(_numbers_file(tmp_path))


@pytest.mark.parametrize("metadata, what", [
    ({"toyarch.block_count": 3}, "block_count is 3, but the file has tensors for blocks 0..1"),
    ({"toyarch.attention.key_length": 10**9},
     "key_length is 1000000000, larger than any tensor dimension in the file (12)"),
    ({"toyarch.rope.dimension_count": 13}, "rope.dimension_count is 13, larger than any tensor dimension"),
    ({"toyarch.attention.head_count_kv": [1, 2**32 - 1]}, "head_count_kv is [1, 4294967295], larger than"),
    ({"toyarch.attention.key_length": 0}, "key_length is 0: a positive count is needed"),
    ({"toyarch.ssm.time_step_rank": 0}, "time_step_rank is 0: a positive count is needed"),
    ({"toyarch.attention.head_count": -3}, "head_count holds -3: counts are non-negative integers"),
    ({"toyarch.attention.key_length": None, "toyarch.attention.head_count": 9},
     "more heads than the 8 embedding_length"),
    ({"toyarch.rope.freq_base": float("nan")}, "freq_base is nan: a finite value above 0 is needed"),
    ({"toyarch.rope.freq_base": 0.0}, "freq_base is 0.0: a finite value above 0"),
    ({"toyarch.attention.layer_norm_rms_epsilon": -0.5}, "epsilon is -0.5: a finite value of 0 or more"),
    ({"toyarch.attention.sliding_window": 65}, "sliding_window is 65, wider than the 64-token context_length"),
])
def test_sizes_and_floats_the_file_cannot_back_are_refused_in_one_line(tmp_path, metadata, what):
    with pytest.raises(DamagedFile, match=re.escape(what)) as error:
        check_numbers(_numbers_file(tmp_path, metadata))
    assert "\n" not in str(error.value)


def test_a_non_finite_weight_is_named(tmp_path):
    bad = torch.ones(Q, D)
    bad[2, 3] = float("inf")
    gguf = _numbers_file(tmp_path, tensors={"blk.1.attn_q.weight": bad})
    check_numbers(gguf)  # the numbers are fine: only the values are damaged
    what = "tensor 'blk.1.attn_q.weight' holds 1 NaN or infinite values of 96"
    with pytest.raises(DamagedFile, match=re.escape(what)):
        check_finite(gguf)
