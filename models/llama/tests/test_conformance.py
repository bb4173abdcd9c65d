"""verispec's TrunkConformance suite on tiny llama and qwen2 fixtures, in every weight dtype.

int8, int4 and gguf declare `spec_batch_invariant`, so the suite demands bitwise-equal rows there;
bf16 (oneDNN blocking that depends on the CPU) and float32 (MKL gemm) do not, and are held to
the suite's atol instead.
"""
import pytest
import torch
from verispec.weights.quant import WEIGHT_DTYPES
from verispec.seams import Segment, Trunk, declared
from verispec.testing import TrunkConformance, forward_one, plain_logits
from verispec_llama.loader import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models


@pytest.fixture(scope="module", params=[(arch, dtype) for arch in ("llama_int8", "qwen2_int8")
                                        for dtype in WEIGHT_DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tiny_fixture):
    arch, dtype = request.param
    _, path = tiny_fixture(arch)
    return load(path, dtype=dtype)


#: row drift allowed where a dtype is not batch-invariant: fp32 gemm blocking moves ~1e-6; bf16
#: rounds each matmul's output to 8 significant bits, so another blocking moves a logit by an ulp.
NOT_INVARIANT_ATOL = {"float32": 1e-4, "bfloat16": 0.25}


def _assert_rows_equal(trunk, actual, expected, what=""):
    """Bitwise when the trunk declares batch invariance, else within its dtype's drift."""
    assert actual.shape == expected.shape, what
    if declared(trunk, "spec_batch_invariant"):
        assert torch.equal(actual, expected), f"{what} max |diff| {(actual - expected).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(actual, expected, atol=NOT_INVARIANT_ATOL[trunk.dtype], rtol=0,
                                   msg=lambda m: f"{what} {m}")


class TestLlamaConformance(TrunkConformance):
    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype in ("int8", "int4", "gguf"))
    assert declared(loaded, "speculation_refusal") is None
    assert declared(loaded, "speculation_profitable") is True
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8
    assert loaded.view().tap_feature_size(None) == loaded.config.hidden_size == loaded.hidden_size
    assert loaded.tokenizer.vocab_size == loaded.vocab_size


def test_truncate_to_zero_empties_the_sequence(loaded):
    seq = loaded.new_sequence()
    first = forward_one(loaded, seq, [3, 4, 5], logits="last").logits[0]
    forward_one(loaded, seq, [9, 9], logits="last")
    loaded.truncate(seq, 0)
    assert loaded.seq_len(seq) == 0
    assert torch.equal(forward_one(loaded, seq, [3, 4, 5], logits="last").logits[0], first)
    fresh = loaded.new_sequence()  # what reset() was: a new sequence starts empty
    assert fresh != seq and loaded.seq_len(fresh) == 0
    assert torch.equal(forward_one(loaded, fresh, [3, 4, 5], logits="last").logits[0], first)
    loaded.release(seq)
    with pytest.raises(ValueError, match="unknown sequence"):
        loaded.seq_len(seq)
    loaded.release(fresh)


def test_truncate_to_any_prefix_is_exact(loaded):
    """Every layer is attention over a PagedKVCache (no recurrent state, no ring), so a
    sequence can be cut back to any prefix, never refused, and continue with the same bits."""
    tokens = [3, 4, 5, 9, 9, 7, 1]
    seq = loaded.new_sequence()
    reference = forward_one(loaded, seq, tokens).logits  # [n, V]
    for length in range(len(tokens) - 1, 0, -1):
        loaded.truncate(seq, length)
        assert loaded.seq_len(seq) == length
        _assert_rows_equal(loaded, forward_one(loaded, seq, tokens[length:]).logits, reference[length:],
                           f"truncated to {length}:")
    loaded.release(seq)


def _linears_not_batch_invariant(model) -> list[str]:
    """Linears of `model` whose kernel, on this CPU, gives an n-row matmul (n <= the chunk
    length) other bits than n one-row matmuls: the declaration's premise, probed directly."""
    g = torch.Generator().manual_seed(0)
    broken = []
    for name, module in model.named_modules():
        if getattr(module, "batch_invariant", False) and hasattr(module, "in_features"):
            for n in range(2, model.max_rows_per_forward + 1):
                x = torch.randn(n, module.in_features, generator=g)
                if not torch.equal(module(x), torch.cat([module(x[i:i + 1]) for i in range(n)])):
                    broken.append(f"{name} ({type(module).__name__}, {n} rows)")
                    break
    return broken


def test_long_prefill_rows_equal_one_row_decodes(loaded):
    """A prefill longer than max_rows_per_forward (several chunks) gives each row the bits of
    a one-row decode when the dtype is declared batch-invariant."""
    tokens = torch.randint(0, loaded.vocab_size, (loaded.max_rows_per_forward + 9,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    seq = loaded.new_sequence()
    together = forward_one(loaded, seq, tokens).logits
    loaded.release(seq)
    alone = plain_logits(loaded, tokens)
    assert together.shape == alone.shape == (len(tokens), loaded.vocab_size)
    assert not (declared(loaded, "spec_batch_invariant") and _linears_not_batch_invariant(loaded)), (
        "a linear declared batch-invariant is not on this CPU (core weights.quant)")
    _assert_rows_equal(loaded, together, alone)


def test_prefill_beside_a_verify_equals_their_solo_runs(loaded):
    """One forward holding a long prefill of one sequence (crossing a chunk boundary) and a
    3-row verify of another: each segment's rows are its solo run's, bitwise when invariant."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, loaded.vocab_size, (loaded.max_rows_per_forward - 2,), generator=g).tolist()
    context, rows = [4, 8, 15, 16], [23, 42, 7]
    together = [loaded.new_sequence(), loaded.new_sequence()]
    alone = [loaded.new_sequence(), loaded.new_sequence()]
    for seq in (together[1], alone[1]):
        forward_one(loaded, seq, context, logits="none")
    batch = [Segment(together[0], prompt, logits="all", hidden=True),
             Segment(together[1], rows, logits="all", hidden=True, verify=True)]
    outputs = loaded.forward(batch)
    solos = [forward_one(loaded, alone[0], prompt, hidden=True),
             forward_one(loaded, alone[1], rows, hidden=True, verify=True)]
    for what, out, solo in zip(("prefill", "verify"), outputs, solos):
        _assert_rows_equal(loaded, out.logits, solo.logits, f"{what} logits:")
        _assert_rows_equal(loaded, out.hidden, solo.hidden, f"{what} hidden:")
    for seq in (together[1], alone[1]):
        loaded.keep(seq, 1)
    assert [loaded.seq_len(s) for s in together] == [loaded.seq_len(s) for s in alone] == [len(prompt), 5]
    for seq in together + alone:
        loaded.release(seq)
