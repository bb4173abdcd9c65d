"""The GatedDeltaNet's Triton delta rule under Triton's interpreter (TRITON_INTERPRET=1, CPU
tensors): bitwise its PyTorch statement with the state after every row, a verify's rows the
same bits as one-row decodes, within fp32 rounding of the layer's einsum loop, and the layer's
recurrence dispatched to it."""
import os

import pytest
import torch
import torch.nn.functional as F

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.nn.state import RecurrentState  # noqa: E402
from verispec.kernels import triton_delta_rule  # noqa: E402
from verispec.kernels.triton_delta_rule import delta_rule, reference_delta_rule  # noqa: E402

NV, DK, DV = 3, 8, 12  # dv 12: not a power of two (masked lanes), as the tiny fixture's


def _inputs(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(m, NV, DK, generator=g), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(m, NV, DK, generator=g), dim=-1)
    v = torch.randn(m, NV, DV, generator=g)
    beta = torch.rand(m, NV, generator=g)
    decay = (-torch.rand(m, NV, generator=g) * 0.5).exp()
    return q, k, v, beta, decay, torch.randn(NV, DK, DV, generator=g)


def _on_device(*args):
    return tuple(t.cpu() for t in delta_rule(*(t.to(DEVICE) for t in args)))


def test_bitwise_the_pytorch_statement_with_every_rows_state():
    args = _inputs(5)
    out, states = _on_device(*args)
    ref_out, ref_states = reference_delta_rule(*args)
    assert torch.equal(out, ref_out) and torch.equal(states, ref_states)


def test_verify_rows_are_one_row_decodes_and_near_the_einsum_loop():
    q, k, v, beta, decay, state = _inputs(17, seed=1)
    out, states = _on_device(q, k, v, beta, decay, state)
    s = state
    for t in range(17):  # decodes: one row at a time, each from the state the last one emitted
        o1, s1 = _on_device(q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1], decay[t:t + 1], s)
        assert torch.equal(o1[0], out[t]) and torch.equal(s1[0], states[t])
        # the layer's CPU loop (einsum: ATen's order of the dk sums): the same function
        ref = s * decay[t][:, None, None]
        ref = ref + k[t][:, :, None] * (beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", ref, k[t])))[:, None]
        assert (s1[0] - ref).abs().max() < 1e-5
        s = s1[0]


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the layer on CPU tensors under the interpreter")
def test_the_layer_recurrence_runs_it_and_keeps_every_rows_state(monkeypatch):
    from verispec_qwen35.modeling_qwen35 import Qwen35GatedDeltaNet

    layer = Qwen35GatedDeltaNet.__new__(Qwen35GatedDeltaNet)
    torch.nn.Module.__init__(layer)
    layer.nk, layer.nv, layer.dk, layer.dv, layer.kernel = 1, NV, DK, DV, 4
    layer.key_dim, layer.value_dim = DK, NV * DV
    layer.conv_dim, layer.chunked_min_rows = 2 * DK + NV * DV, None
    layer.conv1d_weight = torch.nn.Parameter(torch.randn(layer.conv_dim, 4) * 0.3, requires_grad=False)
    g = torch.Generator().manual_seed(3)
    mix, beta, gl = torch.randn(4, layer.conv_dim, generator=g), torch.rand(4, NV, generator=g), -torch.rand(4, NV, generator=g)
    calls = []
    monkeypatch.setattr(triton_delta_rule, "delta_rule", lambda *a, f=delta_rule: calls.append(1) or f(*a))
    monkeypatch.setenv("VERISPEC_TRITON", "1")  # CPU tensors under the interpreter: as on CUDA
    verify = RecurrentState(layer.state_shapes())
    verify.begin(0, verify=True)
    out = layer.recurrence(mix, beta, gl, verify, record_rows=True)
    assert calls
    decode, decoded = RecurrentState(layer.state_shapes()), []
    for t in range(4):
        decode.begin(t, verify=False)
        assert torch.equal(layer.recurrence(mix[t:t + 1], beta[t:t + 1], gl[t:t + 1], decode, record_rows=False)[0],
                           out[t])
        decoded.append(dict(decode.values))
    verify.keep(2)  # two rows accepted: the state the second decode left, selected, not recomputed
    assert all(torch.equal(verify.values[name], decoded[1][name]) for name in ("conv", "ssm"))
