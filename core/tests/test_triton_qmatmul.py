"""The Triton GGUF block matmul under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors):
bitwise `block_linear.reference_matmul` (the PyTorch statement the C kernel is held to) for
every block type, a row's bits the same whatever rows and tile sizes share its call, and
BlockLinear's forward dispatched to it."""
import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels import ckernels, triton_dispatch, triton_qmatmul  # noqa: E402
from verispec.kernels.triton_qmatmul import qmatmul  # noqa: E402
from verispec.testing.gguf_weights import random_blocks  # noqa: E402
from verispec.weights.block_linear import (  # noqa: E402
    block_linear_class,
    quantize_activations,
    reference_matmul,
    signed_values,
)
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack  # noqa: E402

ROWS, COLS = 40, 256  # 40 outputs: the last output tile partly masked; 256 columns: one K super-block


def _blocks(ggml_type, seed=0):
    return GGUFBlocks(ggml_type, torch.from_numpy(random_blocks(ggml_type, ROWS, COLS, seed)), COLS)


def _x(n, seed=3):
    return torch.randn(n, COLS, generator=torch.Generator().manual_seed(seed))


def _triton(x, values, **tiles):
    args = [None if t is None else t.to(DEVICE) for t in (*quantize_activations(x.to(DEVICE)), *signed_values(values))]
    return qmatmul(*args, values.format.group, **tiles).cpu()


@pytest.mark.parametrize("ggml_type", sorted(BLOCK_FORMATS))
def test_bitwise_the_pytorch_statement(ggml_type):
    values = unpack(_blocks(ggml_type))
    x = _x(5)
    x[1] = 0.0  # an all-zero row: activation scale 0
    assert torch.equal(_triton(x, values), reference_matmul(x, values))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_tiles(ggml_type):
    values = unpack(_blocks(ggml_type, seed=1))
    x = _x(17, seed=4)
    alone = torch.cat([_triton(x[i:i + 1], values) for i in range(17)])
    for n in (2, 5, 9, 17):  # a verify's k + 1 rows
        assert torch.equal(_triton(x[:n], values), alone[:n])
    assert torch.equal(_triton(x, values, block_m=4, block_n=16), alone)


@pytest.mark.skipif(DEVICE != "cpu", reason="drives BlockLinear on CPU tensors under the interpreter")
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_K])
def test_block_linear_dispatches_to_triton(ggml_type, monkeypatch):
    linear = block_linear_class(ggml_type).from_gguf([_blocks(ggml_type, seed=2)])
    x = _x(3, seed=5)
    monkeypatch.setenv("VERISPEC_TRITON", "1")  # CPU tensors under the interpreter: as on CUDA
    assert triton_dispatch.use_triton(x)
    expected = reference_matmul(x, linear.values())
    calls = []
    monkeypatch.setattr(triton_qmatmul, "qmatmul", lambda *a, f=triton_qmatmul.qmatmul, **k: calls.append(1) or f(*a, **k))
    assert torch.equal(linear(x), expected) and calls
    if ckernels.library() is not None:  # VERISPEC_TRITON=0: the C kernel, the same bits
        monkeypatch.setenv("VERISPEC_TRITON", "0")
        assert torch.equal(linear(x), expected) and len(calls) == 1


def test_a_k_that_is_not_the_weights_is_refused():
    values = unpack(_blocks(T.Q4_0))
    with pytest.raises(ValueError, match="the activations have 224 columns; the weight takes 256"):
        _triton(torch.zeros(1, 224), values)
