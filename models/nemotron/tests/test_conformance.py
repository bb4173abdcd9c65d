"""verispec's TrunkConformance suite on the tiny dense and MoE trunks, fp32 and int8.

int8 declares `spec_batch_invariant` (every linear is int8pack_mm, the Mamba-2 step, router and
attention run per row), so the suite demands bitwise-equal rows there; fp32 (MKL gemm) is held
to the suite's atol. The suite covers keep at every row count 0..K for K = 1..16 (per-row
recurrent state selected with no re-forward), sequences in one forward, and 200 random batched
steps.
"""
import pytest
from verispec.seams import Trunk, declared
from verispec.testing import TrunkConformance
from verispec_nemotron.loader import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models


@pytest.fixture(scope="module", ids=lambda p: f"{p[0]}-{p[1]}",
                params=[(name, dtype) for name in ("dense", "moe") for dtype in ("float32", "int8")])
def loaded(request, tiny_fixture):
    name, dtype = request.param
    _, path = tiny_fixture(name)
    return load(path, dtype=dtype, use_cache=False, tokenizer=False)


class TestNemotronConformance(TrunkConformance):
    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert declared(loaded, "speculation_refusal") is None  # the measured verdict (README.md)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
