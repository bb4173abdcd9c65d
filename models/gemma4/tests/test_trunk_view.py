"""Gemma4TrunkView.kv_window: the K/V a head attends as chunks of views into the cache (a sliding
ring: one chunk; a paged layer: one per key block from the first attended one), equal to what
`kv` copies for those positions, committed positions only."""
import torch
from tiny_gemma import TINY_GEMMA4_PLE, make_hf_gemma4, token_ids, write_gemma4_gguf
from verispec.testing import forward_one
from verispec_gemma4.loader import load


def _trunk(tmp_path):
    path = write_gemma4_gguf(tmp_path / "ple.gguf", make_hf_gemma4(TINY_GEMMA4_PLE))
    return load(path, dtype="float32", use_cache=False, tokenizer=False, max_rows_per_forward=16,
                max_verify_rows=16)


def _joined(chunks):
    return tuple(torch.cat(parts, dim=1 if i < 2 else 0) for i, parts in enumerate(zip(*chunks)))


def _by_position(k, v, positions):
    keep = positions >= 0
    order = torch.argsort(positions[keep])
    return positions[keep][order], k[:, keep][:, order], v[:, keep][:, order]


def test_kv_window_reads_the_attended_slots_as_kv_holds_them(tmp_path):
    trunk = _trunk(tmp_path)
    view, seq = trunk.view(), trunk.new_sequence()
    ids = token_ids(145)
    for start in range(0, 140, 16):
        forward_one(trunk, seq, ids[start:min(140, start + 16)], logits="none")
    forward_one(trunk, seq, ids[140:145], logits="all", verify=True)
    trunk.keep(seq, 2)  # 3 rejected rows sit in the caches past position 141
    end = trunk.seq_len(seq)
    for layer, first in [(4, 130), (4, 0), (3, 0), (3, 100), (3, 141)]:  # sliding ring; paged full layer
        got = _by_position(*_joined(view.kv_window(seq, layer, first)))
        want = _by_position(*view.kv(seq, layer))
        inside = (want[0] >= first) & (want[0] < end)
        assert torch.equal(got[0], want[0][inside])
        assert torch.equal(got[1], want[1][:, inside]) and torch.equal(got[2], want[2][:, inside])
    cache = trunk._state(seq).layers
    (ring_k, _, _), = view.kv_window(seq, 4, 130)
    assert ring_k.untyped_storage().data_ptr() == cache[4].k_t.untyped_storage().data_ptr()  # a view
    block = cache[3].k_blocks[2]
    (last_k, _, last_positions), = view.kv_window(seq, 3, 141)  # inside one key block: a view, one block long
    assert last_k.shape[1] == 64 and last_k.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    assert last_positions.tolist() == [-1] * 13 + [141] + [-1] * 50
    chunks = view.kv_window(seq, 3, 100)  # blocks 1 and 2 only, each a view of its block
    assert [k.untyped_storage().data_ptr() for k, _, _ in chunks] == [
        b.untyped_storage().data_ptr() for b in cache[3].k_blocks[1:3]]
    assert len(view.kv_window(seq, 3, 0)) == 3  # the committed positions' blocks, not the capacity
