"""A row computed inside a k-row verify is bitwise the row computed alone, per weight dtype.

The prefix is 58 tokens, so verifies of up to 9 rows straddle the full layer's 64-slot key
block (rows of one verify attend at two key lengths) and the rings (8 + 16 - 1 slots) wrap.
"""
import pytest
import torch
from tiny_gemma import token_ids
from verispec.testing import forward_one

PREFIX = 58
INVARIANT_DTYPES = ["int8", "gguf"]  # bf16 is not invariant on every CPU (weights.quant)


def _one_row_decodes(model, seq, ids):
    """Prefill ids[:PREFIX] into the empty `seq`, then (logits [n, V], hidden [n, D]) of each row of
    ids[PREFIX:], one row per forward; `seq` then holds all of ids."""
    forward_one(model, seq, ids[:PREFIX], logits="last")
    rows = [forward_one(model, seq, ids[i:i + 1], logits="all", hidden=True) for i in range(PREFIX, len(ids))]
    return torch.cat([r.logits for r in rows]), torch.cat([r.hidden for r in rows])


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_verify_rows_are_bitwise_one_row_decodes(load_tiny, dtype):
    model = load_tiny(dtype)
    assert model.spec_batch_invariant
    ids = token_ids(PREFIX + 9, seed=7)
    seq = model.new_sequence()
    logits, hidden = _one_row_decodes(model, seq, ids)
    model.truncate(seq, PREFIX)
    for k in range(2, 10):
        out = forward_one(model, seq, ids[PREFIX:PREFIX + k], logits="all", hidden=True, verify=True)
        assert torch.equal(out.logits, logits[:k]), f"k={k}: max |diff| {(out.logits - logits[:k]).abs().max():.3g}"
        assert torch.equal(out.hidden, hidden[:k])
        model.keep(seq, 0)  # back to the prefix for the next width
        assert model.seq_len(seq) == PREFIX


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float32"])
def test_plain_decode_equals_the_verify_row(load_tiny, dtype):
    model = load_tiny(dtype)
    ids = token_ids(PREFIX + 3, seed=8)
    seq = model.new_sequence()
    forward_one(model, seq, ids[:PREFIX + 2], logits="last")
    plain = forward_one(model, seq, ids[PREFIX + 2:PREFIX + 3], logits="last").logits[0]  # one-row decode: fp32 [V]
    model.truncate(seq, PREFIX + 2)
    one_row = forward_one(model, seq, ids[PREFIX + 2:PREFIX + 3], logits="all", verify=True).logits
    assert plain.dtype == torch.float32 and plain.shape == (model.vocab_size,)
    assert torch.equal(plain, one_row[0])  # same path, same shapes: bitwise for every dtype
    model.truncate(seq, PREFIX)
    three_rows = forward_one(model, seq, ids[PREFIX:PREFIX + 3], logits="all", verify=True).logits
    model.keep(seq, 0)
    plain_last = forward_one(model, seq, ids[PREFIX:PREFIX + 3], logits="last").logits[0]  # LM head on the last row only
    if model.spec_batch_invariant:
        assert torch.equal(three_rows[-1], plain) and torch.equal(plain_last, plain)
    else:  # fp32: a 3-row gemm rounds differently from a 1-row one
        torch.testing.assert_close(three_rows[-1], plain, atol=1e-5, rtol=0)
        torch.testing.assert_close(plain_last, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_prefill_chunking_does_not_change_the_cache(load_tiny, dtype):
    # 40 rows in one call (three chunks) vs one row at a time: the next decode is bitwise equal
    model = load_tiny(dtype)
    ids = token_ids(41, seed=9)
    seq = model.new_sequence()
    forward_one(model, seq, ids[:40], logits="none")
    batched = forward_one(model, seq, ids[40:], logits="last").logits
    model.truncate(seq, 0)  # empties the sequence (rings included) for the one-row run
    for i in range(40):
        forward_one(model, seq, ids[i:i + 1], logits="last")
    assert torch.equal(forward_one(model, seq, ids[40:], logits="last").logits, batched)


def test_float32_is_declared_not_batch_invariant_but_close(load_tiny):
    model = load_tiny("float32")
    assert not model.spec_batch_invariant  # MKL's fp32 gemm changes its blocking with the row count
    ids = token_ids(PREFIX + 9, seed=7)
    seq = model.new_sequence()
    logits, _ = _one_row_decodes(model, seq, ids)
    model.truncate(seq, PREFIX)
    out = forward_one(model, seq, ids[PREFIX:], logits="all", verify=True).logits
    torch.testing.assert_close(out, logits, atol=1e-5, rtol=0)


def test_last_row_logits_only_unless_asked(load_tiny):
    model = load_tiny("int8")
    ids = token_ids(5, seed=10)
    seq = model.new_sequence()
    out = forward_one(model, seq, ids, logits="last", hidden=True)
    assert out.logits.shape == (1, model.vocab_size) and out.hidden.shape == (5, model.view().tap_feature_size(None))
    assert model.seq_len(seq) == 5
    none = forward_one(model, seq, ids[:2], logits="none", hidden=True)
    assert none.logits is None and none.hidden.shape == (2, model.hidden_size)
    assert model.seq_len(seq) == 7
