"""Sliding-window rings under verify + rollback, past the window (W = 8).

With 9-row chunks and verifies the rings hold 8 + 9 - 1 = 16 slots, so a 9-row verify that
keeps few rows has overwritten slots a ring of W slots would still need (the silent bug of
reference/gemma4.md §5.2). The next decode must equal a plain run: bitwise for int8,
within 1e-5 for fp32.
"""
import pytest
import torch
from tiny_gemma import token_ids
from verispec.nn.kv_cache import RewindBeyondWindow

PREFIX, ROWS = 30, 9


def _plain_next_logits(model, ids):
    model.reset()
    for i in range(len(ids)):  # one row per forward: the plain decode path
        logits = model.forward(ids[i:i + 1])
    return logits


def _check(model, got, expected):
    if model.spec_batch_invariant:
        assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max():.3g}"
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("num_kept", [1, 2, 5, ROWS])
def test_decode_after_verify_and_rewind_equals_plain_run(load_tiny, dtype, num_kept):
    model = load_tiny(dtype, max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + ROWS + 1, seed=11)
    wrong = (ids[PREFIX:PREFIX + ROWS] + 1) % model.vocab_size  # rejected rows differ from the kept stream
    verify_rows = torch.cat([ids[PREFIX:PREFIX + num_kept], wrong[num_kept:]])
    model.forward(ids[:PREFIX])
    model.spec_forward(verify_rows, hidden=False, all_logits=True)
    model.spec_rewind_cache(PREFIX + num_kept)  # a no-op when every row was kept
    got = model.forward(ids[PREFIX + num_kept:PREFIX + num_kept + 1])
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + num_kept + 1]))


def test_two_rounds_of_partial_acceptance(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 12, seed=12)
    model.forward(ids[:PREFIX])
    base = PREFIX
    for kept in (3, 4):
        rows = torch.cat([ids[base:base + kept], (ids[base + kept:base + ROWS] + 5) % model.vocab_size])
        model.spec_forward(rows, hidden=False, all_logits=True)
        model.spec_rewind_cache(base + kept)
        base += kept
    got = model.forward(ids[base:base + 1])
    _check(model, got, _plain_next_logits(model, ids[:base + 1]))


def test_rewind_beyond_the_ring_is_refused_and_changes_nothing(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 1, seed=13)
    model.forward(ids[:PREFIX])
    # the rings keep positions 14..29; a query at 18 needs 11..17
    with pytest.raises(RewindBeyondWindow) as err:
        model.spec_rewind_cache(18)
    assert isinstance(err.value, ValueError) and err.value.oldest_needed == 11
    assert model.cache_seq_len == PREFIX
    got = model.forward(ids[PREFIX:])
    _check(model, got, _plain_next_logits(model, ids))
    model.spec_rewind_cache(0)  # always possible: empties the cache
    assert model.cache_seq_len == 0


def test_rewind_within_the_slack_is_exact(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 1, seed=14)
    model.forward(ids)
    model.spec_rewind_cache(PREFIX + 1 - ROWS)  # the furthest a ROWS-row verify can roll back
    got = model.forward(ids[PREFIX + 1 - ROWS:PREFIX + 2 - ROWS])
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + 2 - ROWS]))


def test_default_rings_absorb_the_widest_verify(gemma3_gguf):
    from verispec.nn.kv_cache import MAX_VERIFY_ROWS
    from verispec_gemma4.loader import load

    for dtype, chunk in [("int8", 64), ("bfloat16", 32), ("float32", 64)]:
        model = load(gemma3_gguf, dtype=dtype, use_cache=False, tokenizer=False)
        assert model.max_rows_per_forward == chunk  # bf16 stays within its invariance limit
        ring = model.kv_cache[0]
        assert ring.is_ring and ring.size == 8 + MAX_VERIFY_ROWS - 1


def test_a_verify_wider_than_a_chunk_rolls_back_exactly(load_tiny):
    # 12 rows split into chunks of 5: still one verify, rolled back to 1 kept row by a rewind
    model = load_tiny("int8", max_rows_per_forward=5, max_verify_rows=12)
    ids = token_ids(PREFIX + 12, seed=15)
    model.forward(ids[:PREFIX])
    rows = torch.cat([ids[PREFIX:PREFIX + 1], (ids[PREFIX + 1:PREFIX + 12] + 3) % model.vocab_size])
    wide = model.spec_forward(rows, hidden=False, all_logits=True).logits
    assert wide.shape == (12, model.vocab_size)
    model.spec_rewind_cache(PREFIX + 1)
    got = model.forward(ids[PREFIX + 1:PREFIX + 2])
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + 2]))
