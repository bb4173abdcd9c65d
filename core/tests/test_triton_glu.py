"""act(gate) · up in Triton under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bitwise
`ckernels.reference_glu` (the PyTorch statement the C kernels are held to) for SwiGLU and GeGLU
(tanh), gates from -1e4 to 1e4 (vexp's clamp at -80 included), widths over one column block;
GatedMLP's device path dispatched to it."""
import os

import pytest
import torch

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels import triton_dispatch, triton_glu  # noqa: E402
from verispec.kernels.ckernels import reference_glu  # noqa: E402
from verispec.nn.mlp import GatedMLP  # noqa: E402

#: gates where the arithmetic turns: signed zeros, tiny, around 0, past vexp's clamp (-|g| < -80,
#: and GeGLU's -2|y| < -80 from |g| ~ 5), large
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 5.0, -5.0, 40.0, -40.0, 81.0, -81.0, 200.0, -200.0, 1e4, -1e4]


def _gate_up(n, width, seed=0):
    """[n, 2 · width]: row i scaled by 1, 10, 100, ...; the first row's gates start with SPECIAL."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * width, generator=g) * torch.logspace(0, n - 1, n)[:, None]
    k = min(len(SPECIAL), width)
    gate_up[0, :k] = torch.tensor(SPECIAL[:k])
    return gate_up


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("width", [1, 7, 16, 37, 1100])  # 1100: two column blocks of 1024, the last partly masked
def test_bitwise_the_pytorch_statement(activation, width):
    gate_up = _gate_up(4, width, seed=width)
    got = triton_glu.glu(activation, gate_up.to(DEVICE), width).cpu()
    assert torch.equal(_bits(got), _bits(reference_glu(activation, gate_up, width)))


def test_a_rows_bits_do_not_depend_on_the_call():
    gate_up = _gate_up(9, 40, seed=1)
    for activation in ("silu", "gelu_tanh"):
        alone = torch.cat([triton_glu.glu(activation, gate_up[i:i + 1].to(DEVICE), 40).cpu() for i in range(9)])
        assert torch.equal(_bits(triton_glu.glu(activation, gate_up.to(DEVICE), 40).cpu()), _bits(alone))


def test_what_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="activation 'relu': choose one of silu, gelu_tanh"):
        triton_glu.glu("relu", torch.zeros(1, 8, device=DEVICE), 4)
    with pytest.raises(ValueError, match=r"gate_up \(1, 8\) does not fit \[n, 2 · 5\]"):
        triton_glu.glu("silu", torch.zeros(1, 8, device=DEVICE), 5)


@pytest.mark.skipif(DEVICE != "cpu", reason="drives GatedMLP on CPU tensors under the interpreter")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_on_a_device_dispatches_to_triton(activation, monkeypatch):
    torch.manual_seed(7)
    mlp = GatedMLP(16, 24, activation, kernel_activation=True)
    mlp.device_kernels = True  # as TrunkModule.to_device sets it
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(8)) * 4
    with torch.no_grad():
        gate_up = mlp.gate_up_proj(x).reshape(6, 48)
        expected = mlp.down_proj(reference_glu(activation, gate_up, 24)).view(2, 3, 16)
        calls = []
        monkeypatch.setattr(triton_glu, "glu", lambda *a, f=triton_glu.glu: calls.append(1) or f(*a))
        monkeypatch.setenv("VERISPEC_TRITON", "1")  # CPU tensors under the interpreter: as on CUDA
        assert triton_dispatch.use_triton(x)
        assert torch.equal(_bits(mlp(x)), _bits(expected)) and len(calls) == 1
        monkeypatch.setenv("VERISPEC_TRITON", "0")  # the PyTorch statement, the same bits
        assert torch.equal(_bits(mlp(x)), _bits(expected)) and len(calls) == 1
