"""The trunk seam written once (nn.trunk.SequenceTrunk): sequences, batch checks, chunk packing,
keep and truncate, on the toy trunks. The behavioural cases every trunk must pass are the
conformance suite (test_conformance_toy.py and each model package)."""
import pytest
import torch

from verispec.nn.state import CannotTruncate, RecurrentState, SequenceState
from verispec.seams import ContextOverflow, Segment, Trunk, TrunkView
from verispec.testing import ToyTrunk, forward_one, plain_logits


def test_the_toys_implement_the_seam():
    toy = ToyTrunk()
    assert isinstance(toy, Trunk)
    assert isinstance(toy.view(), TrunkView)


def test_a_forward_that_would_pass_the_context_changes_nothing():
    toy = ToyTrunk(max_context_length=8)
    a, b = toy.new_sequence(), toy.new_sequence()
    forward_one(toy, a, [1, 2, 3])
    with pytest.raises(ContextOverflow, match="need 9 positions but the context holds 8"):
        toy.forward([Segment(b, [4, 5]), Segment(a, list(range(6)))])
    assert (toy.seq_len(a), toy.seq_len(b)) == (3, 0)


def test_bad_batches_are_refused_with_the_reason():
    toy = ToyTrunk()
    seq = toy.new_sequence()
    with pytest.raises(ValueError, match="once per forward"):
        toy.forward([Segment(seq, [1]), Segment(seq, [2])])
    with pytest.raises(ValueError, match="unknown sequence 99"):
        toy.forward([Segment(99, [1])])
    with pytest.raises(ValueError, match="at least one token"):
        Segment(seq, [])
    with pytest.raises(ValueError, match="at least one segment"):
        toy.forward([])
    toy.release(seq)
    with pytest.raises(ValueError, match="unknown sequence"):
        toy.seq_len(seq)


def test_long_segments_split_and_short_ones_share_chunks():
    """Rows packed across chunk boundaries (max 16 rows) give the bits of one-row decodes."""
    toy = ToyTrunk(max_rows_per_forward=16)
    prompts = [list(range(1, 24)), [5, 6, 7], list(range(9, 20))]
    seqs = [toy.new_sequence() for _ in prompts]
    before = toy.num_forwards
    outs = toy.forward([Segment(s, p, logits="all", hidden=True) for s, p in zip(seqs, prompts)])
    assert toy.num_forwards == before + 1
    for prompt, out in zip(prompts, outs):
        assert torch.equal(out.logits, plain_logits(toy, prompt))
        assert out.hidden.shape == (len(prompt), toy.hidden_size)


def test_recurrent_state_cannot_be_truncated_but_attention_can():
    recurrent, attention = ToyTrunk(recurrent=True), ToyTrunk(recurrent=False)
    for toy in (recurrent, attention):
        seq = toy.new_sequence()
        forward_one(toy, seq, [1, 2, 3])
        toy.truncate(seq, 3)  # to its own length: always fine
    with pytest.raises(CannotTruncate, match="cannot be cut back to 2 tokens"):
        recurrent.truncate(0, 2)
    assert recurrent.seq_len(0) == 3
    attention.truncate(0, 2)
    assert attention.seq_len(0) == 2
    recurrent.truncate(0, 0)
    assert recurrent.seq_len(0) == 0


def test_recurrent_keep_selects_the_state_after_the_kept_row():
    state = RecurrentState({"h": (2,)})
    seq = SequenceState([state])
    seq.begin(2, verify=False)
    state.update({"h": torch.tensor([[1.0, 1.0], [2.0, 2.0]])})
    seq.seq_len = 2
    before = state.values["h"]
    for kept, expected in [(0, before), (1, torch.tensor([3.0, 3.0])), (3, torch.tensor([5.0, 5.0]))]:
        seq.begin(3, verify=True)
        state.update({"h": torch.tensor([[3.0, 3.0]])})  # a verify split over two chunks
        state.update({"h": torch.tensor([[4.0, 4.0], [5.0, 5.0]])})
        seq.seq_len += 3
        seq.keep(kept)
        assert torch.equal(state.values["h"], expected) and seq.seq_len == 2 + kept
        if kept:
            seq.truncate(0)
            seq.begin(2, verify=False)
            state.update({"h": torch.tensor([[1.0, 1.0], [2.0, 2.0]])})
            seq.seq_len = 2
    with pytest.raises(ValueError, match="keep\\(4\\)"):
        seq.begin(3, verify=True)
        seq.seq_len += 3
        seq.keep(4)


def test_view_reads_embedding_and_lm_head_without_changing_the_trunk():
    toy = ToyTrunk()
    view = toy.view()
    seq = toy.new_sequence()
    out = forward_one(toy, seq, [3], hidden=True)
    assert torch.equal(view.logits(out.hidden), out.logits)
    assert torch.equal(view.embed(torch.tensor([3])), toy.embedding[[3]])
    assert not hasattr(view, "forward") and not hasattr(view, "keep")


def test_a_refused_keep_changes_no_layer():
    """A ring that cannot undo a verify wider than its slack refuses before the recurrent layer
    ahead of it is rolled back, so the sequence stays whole and a narrower keep still works."""
    from verispec.nn.kv_cache import RewindBeyondWindow, RingKVCache

    recurrent, ring = RecurrentState({"h": (1,)}), RingKVCache(1, 2, window=2, max_rows=2, key_block=1)  # 3 slots
    sequence = SequenceState([recurrent, ring])
    for start, n, verify in [(0, 2, False), (2, 2, False), (4, 3, True)]:
        sequence.begin(n, verify=verify)
        recurrent.update({"h": torch.arange(start + 1, start + n + 1, dtype=torch.float32)[:, None]})
        for p in range(start, start + n):
            ring.write(p, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
        sequence.seq_len = start + n
    with pytest.raises(RewindBeyondWindow):
        sequence.keep(0)  # would need position 3, overwritten by 6
    assert sequence.seq_len == 7 and recurrent.values["h"].item() == 7.0
    sequence.keep(2)
    assert sequence.seq_len == 6 and recurrent.values["h"].item() == 6.0


def test_view_kv_reads_committed_rows_only_and_never_the_trunks_buffers():
    toy = ToyTrunk(recurrent=True)
    seq = toy.new_sequence()
    forward_one(toy, seq, [1, 2, 3, 4])
    forward_one(toy, seq, [5, 6, 7], verify=True)
    toy.keep(seq, 1)  # positions 5 and 6 were rejected: their slots still hold stale rows
    k, v, positions = toy.view().kv(seq, 1)
    assert k.shape[0] == 1 and k.shape[2] == toy.hidden_size and k.shape == v.shape
    assert positions[:5].tolist() == [0, 1, 2, 3, 4] and (positions[5:] == -1).all()
    k.zero_()  # a copy: the trunk is unchanged
    assert toy.view().kv(seq, 1)[0].abs().sum() > 0
    with pytest.raises(ValueError, match="no attention KV"):
        toy.view().kv(seq, 0)  # the recurrent layer


def test_a_context_length_beyond_the_trained_positions_is_refused():
    """`--context-length 1000000` on a model trained on 32768 positions: an error naming both
    raised by TrunkModule._init_sizes before any weight is allocated."""
    from types import SimpleNamespace

    from verispec.errors import VerispecError
    from verispec.nn.trunk_module import ContextBeyondTraining, TrunkModule

    config = SimpleNamespace(vocab_size=10, hidden_size=8, num_hidden_layers=1, max_position_embeddings=32768)
    sizes = SimpleNamespace()
    with pytest.raises(ContextBeyondTraining) as info:
        TrunkModule._init_sizes(sizes, config, "int8", None, 1_000_000)
    assert isinstance(info.value, VerispecError)
    assert "--context-length 1000000 exceeds the 32768 positions" in str(info.value)
    assert "choose at most 32768" in str(info.value)
    for asked, got in ((None, 32768), (32768, 32768), (4096, 4096)):
        TrunkModule._init_sizes(sizes, config, "int8", None, asked)
        assert sizes.max_context_length == got


@pytest.mark.parametrize("trained, advice", [
    (None, "or load the model with a larger --context-length;?$"),
    (64, "larger --context-length, up to 64"),
    (8, r"\(the context already is the model's whole trained length\)"),
])
def test_context_overflow_suggests_a_larger_context_only_below_the_trained_length(trained, advice):
    toy = ToyTrunk(max_context_length=8)
    toy.trained_context_length = trained
    seq = toy.new_sequence()
    with pytest.raises(ContextOverflow, match=advice) as raised:
        toy.forward([Segment(seq, list(range(9)))])
    assert ("larger --context-length" in str(raised.value)) == (trained != 8)
