"""Sliding-window rings under verify + keep and truncate, past the window (W = 8).

With 9-row chunks and verifies the rings hold 8 + 9 - 1 = 16 slots, so a 9-row verify that
keeps few rows has overwritten slots a ring of W slots would still need (the silent bug of
docs/reference/gemma4.md §5.2). The next decode must equal a plain run: bitwise for int8,
within 1e-5 for fp32.
"""
import pytest
import torch
from tiny_gemma import token_ids
from verispec.nn.kv_cache import RewindBeyondWindow, RingKVCache
from verispec.nn.state import CannotTruncate
from verispec.testing import forward_one

PREFIX, ROWS = 30, 9


def _plain_row_logits(model, ids):
    """Logits [len(ids), V] of each row, one row per forward (the plain decode path) in a new sequence."""
    seq = model.new_sequence()
    rows = torch.cat([forward_one(model, seq, ids[i:i + 1], logits="last").logits for i in range(len(ids))])
    model.release(seq)
    return rows


def _plain_next_logits(model, ids):
    return _plain_row_logits(model, ids)[-1:]  # [1, V]


def _check(model, got, expected, what=""):
    if model.spec_batch_invariant:
        assert torch.equal(got, expected), f"{what} max |diff| {(got - expected).abs().max():.3g}"
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=lambda m: f"{what} {m}")


def _prefilled(model, ids):
    seq = model.new_sequence()
    forward_one(model, seq, ids, logits="none")
    return seq


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("num_kept", [1, 2, 5, ROWS])
def test_decode_after_verify_and_keep_equals_plain_run(load_tiny, dtype, num_kept):
    model = load_tiny(dtype, max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + ROWS + 1, seed=11)
    wrong = (ids[PREFIX:PREFIX + ROWS] + 1) % model.vocab_size  # rejected rows differ from the kept stream
    verify_rows = torch.cat([ids[PREFIX:PREFIX + num_kept], wrong[num_kept:]])
    seq = _prefilled(model, ids[:PREFIX])
    forward_one(model, seq, verify_rows, logits="all", verify=True)
    model.keep(seq, num_kept)  # costs nothing when every row was kept
    assert model.seq_len(seq) == PREFIX + num_kept
    got = forward_one(model, seq, ids[PREFIX + num_kept:PREFIX + num_kept + 1], logits="last").logits
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + num_kept + 1]))


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_keep_at_every_row_count_past_the_window(load_tiny, dtype):
    """The prefix (30) has wrapped the rings (16 slots); for every verify width K up to the
    rings' verify slack (ROWS) and every kept count a in 0..K, the next row equals a plain run's."""
    model = load_tiny(dtype, max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + ROWS + 1, seed=16)
    reference = _plain_row_logits(model, ids)  # row i: the logits after token i
    for k in range(1, ROWS + 1):
        for a in range(k + 1):
            rows = torch.cat([ids[PREFIX:PREFIX + a], (ids[PREFIX + a:PREFIX + k] + 1) % model.vocab_size])
            seq = _prefilled(model, ids[:PREFIX])
            forward_one(model, seq, rows, logits="none", verify=True)
            model.keep(seq, a)
            assert model.seq_len(seq) == PREFIX + a
            got = forward_one(model, seq, ids[PREFIX + a:PREFIX + a + 1], logits="last").logits
            _check(model, got, reference[PREFIX + a:PREFIX + a + 1], f"K={k}, kept {a}:")
            model.release(seq)


def test_keep_of_a_verify_wider_than_the_slack_is_refused_and_changes_nothing(load_tiny):
    # ROWS + 1 rows (two chunks) through rings with ROWS rows of slack: keeping none would need
    # position 23, which the verify's last row overwrote; keeping one row is still exact
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + ROWS + 2, seed=17)
    seq = _prefilled(model, ids[:PREFIX])
    rows = torch.cat([ids[PREFIX:PREFIX + 1], (ids[PREFIX + 1:PREFIX + ROWS + 1] + 2) % model.vocab_size])
    forward_one(model, seq, rows, logits="all", verify=True)
    with pytest.raises(RewindBeyondWindow) as err:
        model.keep(seq, 0)
    assert err.value.oldest_needed == PREFIX - 8 + 1 and err.value.oldest_kept == PREFIX + ROWS + 1 - 16
    assert model.seq_len(seq) == PREFIX + ROWS + 1
    model.keep(seq, 1)
    assert model.seq_len(seq) == PREFIX + 1
    got = forward_one(model, seq, ids[PREFIX + 1:PREFIX + 2], logits="last").logits
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + 2]))


def test_two_rounds_of_partial_acceptance(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 12, seed=12)
    seq = _prefilled(model, ids[:PREFIX])
    base = PREFIX
    for kept in (3, 4):
        rows = torch.cat([ids[base:base + kept], (ids[base + kept:base + ROWS] + 5) % model.vocab_size])
        forward_one(model, seq, rows, logits="all", verify=True)
        model.keep(seq, kept)
        base += kept
    assert model.seq_len(seq) == base
    got = forward_one(model, seq, ids[base:base + 1], logits="last").logits
    _check(model, got, _plain_next_logits(model, ids[:base + 1]))


def test_truncate_beyond_the_ring_is_refused_and_changes_nothing(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 1, seed=13)
    seq = _prefilled(model, ids[:PREFIX])
    # the rings keep positions 14..29; a query at 18 needs 11..17
    with pytest.raises(RewindBeyondWindow) as err:
        model.truncate(seq, 18)
    assert isinstance(err.value, CannotTruncate) and isinstance(err.value, ValueError)
    assert err.value.oldest_needed == 11 and err.value.oldest_kept == 14
    assert model.seq_len(seq) == PREFIX
    got = forward_one(model, seq, ids[PREFIX:], logits="last").logits
    expected = _plain_next_logits(model, ids)
    _check(model, got, expected)
    model.truncate(seq, 0)  # always possible: empties the sequence
    assert model.seq_len(seq) == 0
    forward_one(model, seq, ids[:PREFIX], logits="none")  # the emptied rings serve a new prefill exactly
    _check(model, forward_one(model, seq, ids[PREFIX:], logits="last").logits, expected)


def test_truncate_within_the_slack_is_exact(load_tiny):
    model = load_tiny("int8", max_rows_per_forward=ROWS, max_verify_rows=ROWS)
    ids = token_ids(PREFIX + 1, seed=14)
    seq = _prefilled(model, ids)
    model.truncate(seq, PREFIX + 1 - ROWS)  # the furthest a ROWS-row verify can roll back
    assert model.seq_len(seq) == PREFIX + 1 - ROWS
    got = forward_one(model, seq, ids[PREFIX + 1 - ROWS:PREFIX + 2 - ROWS], logits="last").logits
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + 2 - ROWS]))


def test_default_rings_absorb_the_widest_verify(gemma3_gguf):
    from verispec.nn.kv_cache import MAX_VERIFY_ROWS
    from verispec_gemma4.loader import load

    ids = token_ids(20 + MAX_VERIFY_ROWS, seed=18)
    for dtype in ("int8", "bfloat16", "float32"):
        model = load(gemma3_gguf, dtype=dtype, use_cache=False, tokenizer=False)
        assert model.max_rows_per_forward == 64
        seq = _prefilled(model, ids[:20])
        ring = model._sequences[seq].layers[0]
        assert isinstance(ring, RingKVCache) and ring.size == 8 + MAX_VERIFY_ROWS - 1
        # the widest verify the loop sends (split into chunks), all rows rejected: still exact
        rows = (ids[20:20 + MAX_VERIFY_ROWS] + 1) % model.vocab_size
        forward_one(model, seq, rows, logits="none", verify=True)
        model.keep(seq, 0)
        got = forward_one(model, seq, ids[20:21], logits="last").logits
        _check(model, got, _plain_next_logits(model, ids[:21]), dtype)


def test_a_verify_wider_than_a_chunk_keeps_exactly(load_tiny):
    # 12 rows split into chunks of 5: still one verify, rolled back to 1 kept row by keep
    model = load_tiny("int8", max_rows_per_forward=5, max_verify_rows=12)
    ids = token_ids(PREFIX + 12, seed=15)
    seq = _prefilled(model, ids[:PREFIX])
    rows = torch.cat([ids[PREFIX:PREFIX + 1], (ids[PREFIX + 1:PREFIX + 12] + 3) % model.vocab_size])
    wide = forward_one(model, seq, rows, logits="all", verify=True).logits
    assert wide.shape == (12, model.vocab_size)
    model.keep(seq, 1)
    got = forward_one(model, seq, ids[PREFIX + 1:PREFIX + 2], logits="last").logits
    _check(model, got, _plain_next_logits(model, ids[:PREFIX + 2]))
