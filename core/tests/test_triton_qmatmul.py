"""The Triton GGUF block matmul under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors):
bitwise `block_linear.reference_matmul` (the PyTorch statement the C kernel is held to) for
every block type, and a row's bits the same whatever rows and tile sizes share its call."""
import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

os.environ["TRITON_INTERPRET"] = "1"  # read as triton is imported and as the kernel is built
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

from verispec.kernels.triton_qmatmul import TritonBlockWeights, qmatmul  # noqa: E402
from verispec.testing.gguf_weights import random_blocks  # noqa: E402
from verispec.weights.block_linear import reference_matmul  # noqa: E402
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack  # noqa: E402

ROWS, COLS = 40, 256  # 40 outputs: the last output tile partly masked; 256 columns: one K super-block


def _values(ggml_type, seed=0):
    return unpack(GGUFBlocks(ggml_type, torch.from_numpy(random_blocks(ggml_type, ROWS, COLS, seed)), COLS))


def _x(n, seed=3):
    return torch.randn(n, COLS, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ggml_type", sorted(BLOCK_FORMATS))
def test_bitwise_the_pytorch_statement(ggml_type):
    values = _values(ggml_type)
    x = _x(5)
    x[1] = 0.0  # an all-zero row: activation scale 0
    y = qmatmul(x, TritonBlockWeights.from_values(values))
    assert torch.equal(y, reference_matmul(x, values))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_tiles(ggml_type):
    weights = TritonBlockWeights.from_values(_values(ggml_type, seed=1))
    x = _x(17, seed=4)
    alone = torch.cat([qmatmul(x[i:i + 1], weights) for i in range(17)])
    for n in (2, 5, 9, 17):  # a verify's k + 1 rows
        assert torch.equal(qmatmul(x[:n], weights), alone[:n])
    assert torch.equal(qmatmul(x, weights, block_m=4, block_n=16), alone)


def test_a_k_that_is_not_the_weights_is_refused():
    weights = TritonBlockWeights.from_values(_values(T.Q4_0))
    with pytest.raises(ValueError, match="x has 224 columns; the weight takes 256"):
        qmatmul(torch.zeros(1, 224), weights)
