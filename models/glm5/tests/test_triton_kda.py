"""GLM-5.3-Flash's KDA on the Triton delta rule (verispec.kernels.triton_delta_rule, decay per key
channel) under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bitwise its PyTorch
statement with the state after every row, rows 1..17 of one call the same bits as one-row calls
from the emitted states, the layer's recurrence within fp32 rounding of its CPU einsum loop, and
a tiny glm5-next trunk under VERISPEC_TRITON=1 whose verify + keep leaves the KDA state bitwise
the state a plain decode of the kept rows leaves on the same path."""
import os

import pytest
import torch
import torch.nn.functional as F

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels import triton_delta_rule  # noqa: E402
from verispec.kernels.triton_delta_rule import delta_rule, reference_delta_rule  # noqa: E402
from verispec.nn.state import RecurrentState  # noqa: E402

NV, DK, DV = 3, 8, 12  # dk != dv: the state's [dk, dv] layout; dv 12 not a power of two (masked lanes)


def _inputs(m, seed=0, dk=DK, dv=DV):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(m, NV, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(m, NV, dk, generator=g), dim=-1)
    v = torch.randn(m, NV, dv, generator=g)
    beta = torch.rand(m, NV, generator=g)
    decay = (-5.0 * torch.rand(m, NV, dk, generator=g)).exp()  # per key channel, as KDA's lb = -5
    return q, k, v, beta, decay, torch.randn(NV, dk, dv, generator=g)


def _on_device(*args):
    return tuple(t.cpu() for t in delta_rule(*(t.to(DEVICE) for t in args)))


def test_bitwise_the_pytorch_statement_with_a_per_channel_decay():
    args = _inputs(5)
    out, states = _on_device(*args)
    ref_out, ref_states = reference_delta_rule(*args)
    assert torch.equal(out, ref_out) and torch.equal(states, ref_states)
    # the channels' decays differ, so a per-head decay (any one channel's) gives other bits
    q, k, v, beta, decay, state = args
    assert not torch.equal(_on_device(q, k, v, beta, decay[..., 0], state)[1], states)


def test_rows_1_to_17_of_one_call_are_one_row_calls_from_the_emitted_states():
    q, k, v, beta, decay, state = _inputs(17, seed=1)
    out, states = _on_device(q, k, v, beta, decay, state)
    s = state
    for t in range(17):  # decodes: one row at a time, each from the state the last one emitted
        o1, s1 = _on_device(q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1], decay[t:t + 1], s)
        assert torch.equal(o1[0], out[t]) and torch.equal(s1[0], states[t]), t
        s = s1[0]
    for width in (2, 5, 9):  # shorter calls from the same state: the 17-row call's first rows
        ow, sw = _on_device(q[:width], k[:width], v[:width], beta[:width], decay[:width], state)
        assert torch.equal(ow, out[:width]) and torch.equal(sw, states[:width]), width


def _layer(heads=NV, hd=16, kernel=4, seed=3):
    from verispec_glm5.modeling_glm5next import KdaAttention

    layer = KdaAttention.__new__(KdaAttention)
    torch.nn.Module.__init__(layer)
    layer.heads, layer.hd, layer.kernel = heads, hd, kernel
    layer.di = heads * hd
    g = torch.Generator().manual_seed(seed)
    layer.conv1d_weight = torch.nn.Parameter(torch.randn(3 * layer.di, 1, kernel, generator=g) * 0.3,
                                             requires_grad=False)
    return layer


def _layer_inputs(layer, m, seed=4):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(m, 3 * layer.di, generator=g)
    beta = torch.rand(m, layer.heads, generator=g)
    log_decay = -5.0 * torch.rand(m, layer.heads, layer.hd, generator=g)
    return mix, beta, log_decay


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the layer on CPU tensors under the interpreter")
def test_the_kda_recurrence_runs_it_near_its_cpu_loop_and_keeps_every_rows_state(monkeypatch):
    layer, m = _layer(hd=32), 6  # hd 32: ATen's einsum order differs from the kernel's here (16: it agrees)
    mix, beta, gl = _layer_inputs(layer, m)
    g = torch.Generator().manual_seed(5)
    start = {name: torch.randn(shape, generator=g) for name, shape in layer.state_shapes().items()}

    def fresh(verify):  # a sequence at position 0 holding `start`
        state = RecurrentState(layer.state_shapes())
        state.values = {name: value.clone() for name, value in start.items()}
        state.begin(0, verify=verify)
        return state

    cpu = fresh(True)
    monkeypatch.setenv("VERISPEC_TRITON", "0")
    cpu_out = layer.recurrence(mix, beta, gl, cpu, record_rows=True)
    calls = []
    monkeypatch.setattr(triton_delta_rule, "delta_rule", lambda *a, f=delta_rule: calls.append(1) or f(*a))
    monkeypatch.setenv("VERISPEC_TRITON", "1")  # CPU tensors under the interpreter: as on CUDA
    verify = fresh(True)
    out = layer.recurrence(mix, beta, gl, verify, record_rows=True)
    assert calls
    # the same function as the CPU loop; only the order of the dk sums differs (measured: 1.5e-8)
    assert (out - cpu_out).abs().max() < 1e-5
    decode, decoded = fresh(False), []
    for t in range(m):  # one-row decodes on the Triton path: each the verify's row, bitwise
        decode.begin(t, verify=False)
        row = layer.recurrence(mix[t:t + 1], beta[t:t + 1], gl[t:t + 1], decode, record_rows=False)
        assert torch.equal(row[0], out[t])
        decoded.append({name: value.clone() for name, value in decode.values.items()})
    cpu.keep(m)
    for name in ("conv", "ssm"):  # the CPU loop's final state, within fp32 rounding
        assert (decoded[-1][name] - cpu.values[name]).abs().max() < 1e-5
    verify.keep(3)  # three rows accepted: the state the third decode left, selected, not recomputed
    assert all(torch.equal(verify.values[name], decoded[2][name]) for name in ("conv", "ssm"))


PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6]
DRAFT = [17, 23, 99, 4, 61, 8]  # 5 draft rows and one after


def _kda_states(trunk, seq):
    return [{k: v.clone() for k, v in s.values.items()} for s, kda in
            zip(trunk._state(seq).layers, trunk.config.kda_layers) if kda]


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the trunk on CPU tensors under the interpreter")
def test_a_trunk_verify_then_keep_is_a_plain_decode_on_the_triton_path(tiny_glm5next_fixture, monkeypatch):
    """int8 (batch-invariant linears), VERISPEC_TRITON=1: a 5-row verify kept at every row count a
    leaves the KDA states (conv windows and delta state) bitwise those of a plain one-row-at-a-time
    decode of a draft tokens on the same path, and the next row's logits bitwise the plain run's;
    a verify beside another sequence's decode in one forward (mixed sequences) keeps the same bits."""
    pytest.importorskip("transformers")  # the fixture is written from a transformers model
    from verispec.seams import Segment
    from verispec.testing import forward_one
    from verispec_glm5.loader_glm5next import load

    calls = []
    monkeypatch.setattr(triton_delta_rule, "delta_rule", lambda *a, f=delta_rule: calls.append(1) or f(*a))
    monkeypatch.setenv("VERISPEC_TRITON", "1")
    trunk = load(tiny_glm5next_fixture("flash")[1], dtype="int8")
    base = trunk.new_sequence()
    forward_one(trunk, base, PROMPT, logits="none")
    assert calls  # the prefill's KDA layers ran the kernel
    plain = trunk.fork(base, len(PROMPT))
    states, logits = [_kda_states(trunk, plain)], []
    for t in DRAFT:
        logits.append(forward_one(trunk, plain, [t]).logits)
        states.append(_kda_states(trunk, plain))
    width = len(DRAFT) - 1
    for accepted in range(width + 1):
        seq = trunk.fork(base, len(PROMPT))
        trunk.forward([Segment(seq, torch.tensor(DRAFT[:width]), verify=True)])
        trunk.keep(seq, accepted)
        for got, want in zip(_kda_states(trunk, seq), states[accepted]):
            assert all(torch.equal(got[k], want[k]) for k in want), accepted
        assert torch.equal(forward_one(trunk, seq, [DRAFT[accepted]]).logits, logits[accepted]), accepted
        trunk.release(seq)
    seq, other = trunk.fork(base, len(PROMPT)), trunk.fork(base, len(PROMPT))
    trunk.forward([Segment(other, torch.tensor(DRAFT[:1])),
                   Segment(seq, torch.tensor(DRAFT[:3]), verify=True)])
    trunk.keep(seq, 2)
    for got, want in zip(_kda_states(trunk, seq), states[2]):
        assert all(torch.equal(got[k], want[k]) for k in want)
    for got, want in zip(_kda_states(trunk, other), states[1]):
        assert all(torch.equal(got[k], want[k]) for k in want)
