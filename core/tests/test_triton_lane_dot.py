"""The fixed-order row dot product in Triton under Triton's interpreter (TRITON_INTERPRET=1, CPU
tensors): bitwise `ckernels.lane_dot` (its PyTorch statement, the RMSNorm kernels' order) for any
dim (tails that are not 16 wide included), y per row or shared; a row's bits the same whatever
rows share its call. (Qwen 3.5's device-path test checks its dispatch.)"""
import os

import pytest
import torch

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels import ckernels, triton_lane_dot  # noqa: E402


def _rows(n, dim, seed=0):
    """n rows, row i scaled by 10^(-15 + 25 i / (n - 1)): products from denormal to ~1e20."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.logspace(-15, 10, n)[:, None]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _triton(x, y):
    return triton_lane_dot.lane_dot(x.to(DEVICE), y.to(DEVICE)).cpu()


@pytest.mark.parametrize("dim", [1, 5, 15, 16, 17, 64, 96, 128, 1000])
@pytest.mark.parametrize("shared_y", [True, False])
def test_bitwise_the_pytorch_statement(dim, shared_y):
    x = _rows(6, dim, seed=dim)
    x[2] = 0.0
    y = _rows(1 if shared_y else 6, dim, seed=dim + 1)
    y = y[0] if shared_y else y
    got = _triton(x, y)
    assert got.shape == (6, 1)
    assert torch.equal(_bits(got), _bits(ckernels.lane_dot(x, y)))
    assert torch.equal(_bits(_triton(x, x)), _bits(ckernels.lane_dot(x, x)))  # Σx², as the RMSNorm's


def test_the_statement_is_the_rms_norms_sum_of_squares():
    """lane_dot(x, x) is the sum reference_rms_norm (the C kernel's statement) divides by dim."""
    x = _rows(5, 40, seed=7)
    mean = ckernels.lane_dot(x, x) / torch.full((5, 1), 40.0) + torch.tensor(1e-6)
    expected = x * (torch.ones(5, 1) / torch.sqrt(mean.double()).float())
    assert torch.equal(_bits(ckernels.reference_rms_norm(x, None, 1e-6)), _bits(expected))


def test_a_rows_bits_do_not_depend_on_the_call():
    x, y = _rows(17, 128, seed=3), _rows(1, 128, seed=4)[0]
    alone = torch.cat([_triton(x[i:i + 1], y) for i in range(17)])
    assert torch.equal(_bits(alone), _bits(ckernels.lane_dot(x, y)))
    for n in range(2, 18):  # a verify's k + 1 rows
        assert torch.equal(_bits(_triton(x[:n], y)), _bits(alone[:n]))


def test_a_y_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match=r"y \(16,\) does not fit x \(2, 17\): it must be \[17\] or \[2, 17\]"):
        triton_lane_dot.lane_dot(torch.zeros(2, 17, device=DEVICE), torch.ones(16, device=DEVICE))
