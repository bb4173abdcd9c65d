"""RMSNorm in Triton under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bitwise
`ckernels.reference_rms_norm` (the PyTorch statement the C kernel is held to) for any dim (tails
that are not 16 wide included), rows of every magnitude, with and without a weight; a row's bits
the same whatever rows share its call; RMSNorm's device path dispatched to it."""
import os

import pytest
import torch

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels import triton_dispatch, triton_norm  # noqa: E402
from verispec.kernels.ckernels import reference_rms_norm  # noqa: E402
from verispec.nn.norm import RMSNorm  # noqa: E402

EPS = 1e-6  # not an fp32: the kernel and the statement both round it


def _rows(n, dim, seed=0):
    """n rows, row i scaled by 10^(-20 + 35 i / (n - 1)): squares from denormal (eps decides) to ~1e34."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.logspace(-20, 15, n)[:, None]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _triton(x, weight, eps=EPS):
    return triton_norm.rms_norm(x.to(DEVICE), None if weight is None else weight.to(DEVICE), eps).cpu()


@pytest.mark.parametrize("dim", [1, 15, 16, 17, 64, 96, 640, 1536])  # 640: Gemma 3 270M's hidden size
@pytest.mark.parametrize("with_weight", [True, False])
def test_bitwise_the_pytorch_statement(dim, with_weight):
    x = _rows(6, dim, seed=dim)
    x[2] = 0.0  # an all-zero row: mean = eps
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(dim + 1)) if with_weight else None
    assert torch.equal(_bits(_triton(x, weight)), _bits(reference_rms_norm(x, weight, EPS)))


def test_a_rows_bits_do_not_depend_on_the_call():
    x, weight = _rows(17, 96, seed=3), torch.randn(96, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([_triton(x[i:i + 1], weight) for i in range(17)])
    assert torch.equal(_bits(alone), _bits(reference_rms_norm(x, weight, EPS)))
    for n in range(2, 18):  # a verify's k + 1 rows
        assert torch.equal(_bits(_triton(x[:n], weight)), _bits(alone[:n]))


def test_a_weight_that_is_not_dim_is_refused():
    with pytest.raises(ValueError, match=r"weight \(16,\) does not fit x \(2, 17\): it must be \[17\]"):
        triton_norm.rms_norm(torch.zeros(2, 17, device=DEVICE), torch.ones(16, device=DEVICE), EPS)


@pytest.mark.skipif(DEVICE != "cpu", reason="drives RMSNorm on CPU tensors under the interpreter")
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_on_a_device_dispatches_to_triton(with_weight, monkeypatch):
    norm = RMSNorm(17, eps=1e-5, with_weight=with_weight)
    if with_weight:
        norm.weight.data = torch.randn(17, generator=torch.Generator().manual_seed(5))
    norm.device_kernels = True  # as TrunkModule.to_device sets it
    x = _rows(6, 17, seed=6).view(2, 3, 17)  # [..., dim]: the rows flattened
    expected = reference_rms_norm(x.view(6, 17), norm.weight, 1e-5).view(2, 3, 17)
    calls = []
    monkeypatch.setattr(triton_norm, "rms_norm", lambda *a, f=triton_norm.rms_norm: calls.append(1) or f(*a))
    monkeypatch.setenv("VERISPEC_TRITON", "1")  # CPU tensors under the interpreter: as on CUDA
    assert triton_dispatch.use_triton(x)
    assert torch.equal(_bits(norm(x)), _bits(expected)) and len(calls) == 1
    monkeypatch.setenv("VERISPEC_TRITON", "0")  # the PyTorch statement, the same bits
    assert torch.equal(_bits(norm(x)), _bits(expected)) and len(calls) == 1
