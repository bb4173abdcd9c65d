"""A row computed inside a k-row verify is bitwise the row computed alone, per weight dtype.

The prefix is 58 tokens, so verifies of up to 9 rows straddle the full layer's 64-slot key
block (rows of one verify attend at two key lengths) and the rings (8 + 16 - 1 slots) wrap.
"""
import pytest
import torch
from tiny_gemma import token_ids

PREFIX = 58
INVARIANT_DTYPES = ["int8", "bfloat16"]


def _one_row_decodes(model, ids):
    """(logits [n, V], hidden [n, D]) of each row of ids[PREFIX:], one row per forward."""
    model.reset()
    model.forward(ids[:PREFIX])
    rows = [model.spec_forward(ids[i:i + 1], hidden=True, all_logits=True) for i in range(PREFIX, len(ids))]
    return torch.cat([r.logits for r in rows]), torch.cat([r.hidden for r in rows])


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_verify_rows_are_bitwise_one_row_decodes(load_tiny, dtype):
    model = load_tiny(dtype)
    assert model.spec_batch_invariant
    ids = token_ids(PREFIX + 9, seed=7)
    logits, hidden = _one_row_decodes(model, ids)
    for k in range(2, 10):
        model.spec_rewind_cache(PREFIX)
        out = model.spec_forward(ids[PREFIX:PREFIX + k], hidden=True, all_logits=True)
        assert torch.equal(out.logits, logits[:k]), f"k={k}: max |diff| {(out.logits - logits[:k]).abs().max():.3g}"
        assert torch.equal(out.hidden, hidden[:k])


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float32"])
def test_plain_forward_equals_spec_forward_row(load_tiny, dtype):
    model = load_tiny(dtype)
    ids = token_ids(PREFIX + 3, seed=8)
    model.forward(ids[:PREFIX + 2])
    plain = model.forward(ids[PREFIX + 2:PREFIX + 3])  # one-row plain decode: fp32 [V]
    model.spec_rewind_cache(PREFIX + 2)
    one_row = model.spec_forward(ids[PREFIX + 2:PREFIX + 3], hidden=False, all_logits=True).logits
    assert plain.dtype == torch.float32 and plain.shape == (model.vocab_size,)
    assert torch.equal(plain, one_row[0])  # same path, same shapes: bitwise for every dtype
    model.spec_rewind_cache(PREFIX)
    three_rows = model.spec_forward(ids[PREFIX:PREFIX + 3], hidden=False, all_logits=True).logits
    model.spec_rewind_cache(PREFIX)
    plain_last = model.forward(ids[PREFIX:PREFIX + 3])  # the LM head runs on the last row only
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
    model.forward(ids[:40])
    batched = model.forward(ids[40:])
    model.reset()
    for i in range(40):
        model.forward(ids[i:i + 1])
    assert torch.equal(model.forward(ids[40:]), batched)


def test_float32_is_declared_not_batch_invariant_but_close(load_tiny):
    model = load_tiny("float32")
    assert not model.spec_batch_invariant  # MKL's fp32 gemm changes its blocking with the row count
    ids = token_ids(PREFIX + 9, seed=7)
    logits, _ = _one_row_decodes(model, ids)
    model.spec_rewind_cache(PREFIX)
    out = model.spec_forward(ids[PREFIX:], hidden=False, all_logits=True).logits
    torch.testing.assert_close(out, logits, atol=1e-5, rtol=0)


def test_last_row_logits_only_unless_asked(load_tiny):
    model = load_tiny("int8")
    ids = token_ids(5, seed=10)
    out = model.spec_forward(ids, hidden=True, all_logits=False)
    assert out.logits.shape == (1, model.vocab_size) and out.hidden.shape == (5, model.spec_feature_size)
    assert model.cache_seq_len == 5
