"""verispec's TargetConformance suite on tiny llama and qwen2 fixtures, in every weight dtype.

int8 and bf16 declare `spec_batch_invariant`, so the suite demands bitwise-equal rows there;
float32 (MKL gemm) does not, and is held to the suite's atol instead.
"""
import pytest
from verispec.nn.quant import WEIGHT_DTYPES
from verispec.seams import SpeculativeTarget, declared
from verispec.testing import TargetConformance
from verispec_llama.loader import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models


@pytest.fixture(scope="module", params=[(arch, dtype) for arch in ("llama_int8", "qwen2_int8")
                                        for dtype in WEIGHT_DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tiny_fixture):
    arch, dtype = request.param
    _, path = tiny_fixture(arch)
    return load(path, dtype=dtype)


class TestLlamaConformance(TargetConformance):
    @pytest.fixture
    def target(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, SpeculativeTarget)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype != "float32")
    assert declared(loaded, "spec_has_recurrent_state") is False
    assert declared(loaded, "spec_verify_persists_accepted_kv") is True
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_draft_window") <= 8
    assert loaded.spec_feature_size == loaded.config.hidden_size
    assert loaded.tokenizer.vocab_size == loaded.vocab_size


def test_rewind_to_zero_empties_the_cache(loaded):
    import torch

    loaded.spec_rewind_cache(0)
    first = loaded.forward(torch.tensor([3, 4, 5]))
    loaded.forward(torch.tensor([9, 9]))
    loaded.spec_rewind_cache(0)
    assert loaded.cache_seq_len == 0
    assert torch.equal(loaded.forward(torch.tensor([3, 4, 5])), first)
    loaded.reset()
    assert loaded.cache_seq_len == 0


def test_long_prefill_rows_equal_one_row_decodes(loaded):
    """A prefill longer than max_rows_per_forward (several chunks) gives each row the bits of
    a one-row decode when the dtype is declared batch-invariant."""
    import torch

    tokens = torch.randint(0, loaded.vocab_size, (loaded.max_rows_per_forward + 9,),
                           generator=torch.Generator().manual_seed(3))
    loaded.spec_rewind_cache(0)
    together = loaded.spec_forward(tokens, hidden=False, all_logits=True).logits
    loaded.spec_rewind_cache(0)
    alone = torch.stack([loaded.forward(tokens[i:i + 1]) for i in range(tokens.numel())])
    if declared(loaded, "spec_batch_invariant"):
        assert torch.equal(together, alone)
    else:
        torch.testing.assert_close(together, alone, atol=1e-4, rtol=0)
