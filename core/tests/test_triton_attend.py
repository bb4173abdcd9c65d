"""Paged attention in Triton under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors):
bitwise `ckernels.reference_attend` (the PyTorch statement the C kernel is held to) for every
row of several sequences in one call, and a row's bits the same whatever rows share its call."""
import os

import pytest
import torch

# read as triton is imported and as the kernel is built; TRITON_INTERPRET=0 on a GPU machine runs the
# kernel tests on CUDA instead (the references stay on the CPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

from verispec.kernels.ckernels import reference_attend  # noqa: E402
from verispec.kernels.triton_attend import attend  # noqa: E402

B, BLOCKS = 8, 12  # slots per block, blocks in the pool


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pool(Hkv, Dh, seed=0):
    return (torch.randn(BLOCKS, Hkv, Dh, B, generator=_gen(seed)), torch.randn(BLOCKS, Hkv, B, Dh, generator=_gen(seed + 1)))


def _sequence_kv(k_blocks, v_blocks, table, length):
    """Sequence's K transposed [Hkv, Dh, T] and V [Hkv, T, Dh] read through its block table."""
    ids = table[:-(-length // B)].long()
    k_t = k_blocks[ids].permute(1, 2, 0, 3).flatten(2)[..., :length]
    v = v_blocks[ids].permute(1, 0, 2, 3).flatten(1, 2)[:, :length]
    return k_t, v


def _call(q, pools, tables, seqs, slot_pos=None, window=0):
    """seqs: (sequence, first position, rows) per run of rows; each sequence reads up to its last row."""
    row_seq = torch.cat([torch.full((n,), s) for s, _, n in seqs])
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in seqs])
    num_slots = torch.zeros(tables.shape[0], dtype=torch.int32)
    for s, p, n in seqs:
        num_slots[s] = max(int(num_slots[s]), p + n)
    on = [None if t is None else t.to(DEVICE) for t in (q, *pools, tables, row_seq, positions, num_slots, slot_pos)]
    return attend(*on, scaling=0.3, window=window).cpu()


def _expected(q, pools, tables, seqs, slot_pos=None, window=0):
    out, row = [], 0
    for s, p, n in seqs:
        k_t, v = _sequence_kv(*pools, tables[s], p + n)
        sp = torch.arange(p + n) if slot_pos is None else slot_pos[s, :p + n]
        out.append(reference_attend(q[row:row + n], k_t, v, sp, torch.arange(p, p + n), scaling=0.3,
                                    window=window or None))
        row += n
    return torch.cat(out)


TABLES = torch.tensor([[3, 0, 7, 5], [1, 9, 2, 11], [4, 6, 8, 10]], dtype=torch.int32)  # shuffled blocks


@pytest.mark.parametrize("H, Hkv, Dh", [(4, 2, 8), (3, 1, 16)])
@pytest.mark.parametrize("window", [0, 5])
def test_mixed_sequences_bitwise_the_pytorch_statement(H, Hkv, Dh, window):
    pools = _pool(Hkv, Dh, seed=Dh)
    seqs = [(0, 20, 3), (1, 4, 1), (2, 9, 5)]  # a verify, a decode, a prefill chunk crossing blocks
    q = torch.randn(9, H, Dh, generator=_gen(7))
    assert torch.equal(_call(q, pools, TABLES, seqs, window=window), _expected(q, pools, TABLES, seqs, window=window))


def test_slot_positions_of_a_ring_bitwise_the_pytorch_statement():
    pools = _pool(1, 8, seed=3)
    slot_pos = torch.randperm(32, generator=_gen(5)).reshape(1, 32).repeat(3, 1)
    slot_pos[:, 7] = -1  # an empty slot
    seqs = [(0, 26, 2), (2, 30, 1)]
    q = torch.randn(3, 2, 8, generator=_gen(8))
    got = _call(q, pools, TABLES, seqs, slot_pos=slot_pos, window=6)
    assert torch.equal(got, _expected(q, pools, TABLES, seqs, slot_pos=slot_pos, window=6))


def test_blocks_before_a_window_are_not_read():
    """A sliding layer's row reads only the blocks its window reaches: NaN in the blocks before it
    (positions 0..15 of sequence 0, window 5 at positions 20..22) leaves the rows as with zeros."""
    k, v = _pool(2, 8, seed=4)
    q = torch.randn(3, 4, 8, generator=_gen(6))
    zeroed = k.clone(), v.clone()
    for pool, nan in zip(zeroed, (k, v)):
        pool[TABLES[0, :2].long()] = 0.0
        nan[TABLES[0, :2].long()] = float("nan")
    got = _call(q, (k, v), TABLES, [(0, 20, 3)], window=5)
    assert torch.equal(got, _expected(q, zeroed, TABLES, [(0, 20, 3)], window=5))


def test_a_rows_bits_do_not_depend_on_the_call():
    pools = _pool(1, 8, seed=11)
    q = torch.randn(17, 2, 8, generator=_gen(9))
    verify = _call(q, pools, TABLES, [(0, 10, 17)])  # 17 verify rows
    alone = torch.cat([_call(q[i:i + 1], pools, TABLES, [(0, 10 + i, 1)]) for i in (0, 5, 16)])
    assert torch.equal(verify[[0, 5, 16]], alone)
    mixed = _call(torch.cat([q[:4], q[4:6]]), pools, TABLES, [(0, 10, 4), (2, 1, 2)])  # beside another sequence
    assert torch.equal(mixed[:4], verify[:4])


def test_shapes_that_do_not_fit_are_refused():
    pools = _pool(2, 8)
    with pytest.raises(ValueError, match="do not fit"):
        attend(torch.zeros(1, 3, 8), *pools, TABLES, torch.zeros(1), torch.zeros(1), torch.ones(3), scaling=1.0)
