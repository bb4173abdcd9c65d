"""verispec.nn: the shared building blocks, each against a plain reference or transformers."""
import math

import pytest
import torch
from verispec.nn.attention import attend
from verispec.nn.kv_cache import PagedKVCache, RewindBeyondWindow, RingKVCache
from verispec.nn.state import CannotTruncate, SequenceState
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.weights.quant import (
    BFloat16Linear,
    Float32Linear,
    Int4Linear,
    Int8Linear,
    UnknownWeightDtype,
    canonical_dtype,
    linear_class,
    module_batch_invariant,
    quantize_int4,
    quantize_int8,
    rows_per_forward,
    swap_linears,
)
from verispec.nn.rope import (
    RotaryEmbedding,
    default_inv_freq,
    freq_factors,
    linear_scaling,
    proportional_inv_freq,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- norm -----------------------------------------------------------------------------------

def test_rms_norm_multiplies_by_the_stored_weight():
    x = torch.randn(5, 48, generator=_gen())
    norm = RMSNorm(48, eps=1e-6)
    norm.weight.data = torch.randn(48, generator=_gen(1))
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=0)
    plain = RMSNorm(48, with_weight=False)
    assert plain.weight is None
    torch.testing.assert_close(plain(x), expected / norm.weight, atol=1e-5, rtol=0)


# --- rope -----------------------------------------------------------------------------------

def _hf_rotate_half_rope(x, positions, inv_freq):
    """transformers' formulation: x·cos + rotate_half(x)·sin with cos = cat(cos, cos)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def test_neox_rope_equals_transformers_rotate_half():
    rope = RotaryEmbedding.default(16, 10_000.0)
    x = torch.randn(7, 3, 16, generator=_gen())
    positions = torch.arange(100, 107)
    got = rope(x, *rope.cos_sin(positions))
    assert torch.equal(got, _hf_rotate_half_rope(x, positions, default_inv_freq(16, 10_000.0)))


def test_normal_style_is_neox_on_interleaved_pairs():
    # llama.cpp NORM pairs (2i, 2i+1); gathering even dims then odd dims turns it into NEOX
    x = torch.randn(4, 2, 8, generator=_gen())
    positions = torch.arange(4)
    normal = RotaryEmbedding.default(8, 500.0, style="normal")
    neox = RotaryEmbedding.default(8, 500.0)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    got = normal(x, *normal.cos_sin(positions))[..., order]
    torch.testing.assert_close(got, neox(x[..., order], *neox.cos_sin(positions)), atol=1e-6, rtol=0)


def test_partial_rotary_passes_the_tail_through():
    rope = RotaryEmbedding.default(8, 10_000.0)  # rotates 8 of 12 dims
    x = torch.randn(3, 2, 12, generator=_gen())
    out = rope(x, *rope.cos_sin(torch.arange(5, 8)))
    assert torch.equal(out[..., 8:], x[..., 8:])
    full = RotaryEmbedding.default(8, 10_000.0)
    assert torch.equal(out[..., :8], full(x[..., :8], *full.cos_sin(torch.arange(5, 8))))


def test_frequency_hooks():
    inv = default_inv_freq(8, 1e4)
    assert torch.equal(RotaryEmbedding(inv, scaling=linear_scaling(8.0)).inv_freq, inv / 8.0)
    assert torch.equal(RotaryEmbedding(inv, scaling=freq_factors([1, 2, 4, 8])).inv_freq,
                       inv / torch.tensor([1.0, 2, 4, 8]))
    proportional = proportional_inv_freq(32, 1e6, 0.25)  # Gemma 4 full layers: 4 of 16 pairs rotate
    assert proportional.shape == (16,) and (proportional[4:] == 0).all()
    assert torch.equal(proportional[:4], 1.0 / 1e6 ** (torch.arange(0, 8, 2).float() / 32))
    with pytest.raises(ValueError, match="neox"):
        RotaryEmbedding(inv, style="gptj")


# --- quant ----------------------------------------------------------------------------------

def test_int8_quantisation_never_clips_and_stays_close():
    w = torch.randn(64, 96, generator=_gen()) * 0.05
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert (scales.float() >= w.abs().amax(1) / 127).all()  # rounded up: the largest weight fits
    error = (q.float() * scales.float()[:, None] - w).abs()
    assert (error <= scales.float()[:, None] / 2 + 1e-9).all()


def test_int4_quantisation_is_groupwise_and_stays_within_half_a_step():
    w = torch.randn(48, 96, generator=_gen()) * 0.05
    q, scales_zeros = quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and scales_zeros.shape == (3, 48, 2)
    scale = scales_zeros[..., 0].float().t().repeat_interleave(32, dim=1)  # [48, 96]
    zero = scales_zeros[..., 1].float().t().repeat_interleave(32, dim=1)
    assert ((q.float() - 8) * scale + zero - w).abs().max() <= scale.max() * 0.51 + 1e-3  # bf16 scale/zero


def test_bf16_is_not_declared_batch_invariant():
    """On this AVX-512 BF16 CPU an n-row bf16 matmul gave other bits than n one-row matmuls
    (48 -> 80 at n = 21): no dtype may claim what some CPU breaks."""
    assert not BFloat16Linear.batch_invariant and canonical_dtype("bf16") == "bfloat16"
    assert linear_class("bf16") is BFloat16Linear and rows_per_forward("bf16") == 64


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("in_features", [64, 37])  # 37: int8 pads to a multiple of 16, int4 to 32 (and 40 rows to 48)
def test_invariant_linears_are_bitwise_per_row(cls, in_features):
    layer = cls.from_float(torch.randn(40, in_features, generator=_gen()) * 0.1)
    x = torch.randn(cls.max_invariant_rows or 33, in_features, generator=_gen(1))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    for n in range(2, x.shape[0] + 1):
        assert torch.equal(layer(x[:n]), alone[:n]), f"{cls.__name__} n={n}"
    reference = x @ layer.rows(torch.arange(40)).T
    torch.testing.assert_close(layer(x), reference, atol=0.05, rtol=0.02)  # bf16-rounded input/output


def test_rows_gather_the_weight():
    w = torch.randn(10, 32, generator=_gen())
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(Float32Linear.from_float(w).rows(ids), w[ids])
    assert torch.equal(BFloat16Linear.from_float(w).rows(ids), w.bfloat16().float()[ids])
    q, s = quantize_int8(w)
    assert torch.equal(Int8Linear.from_float(w).rows(ids), (q.float() * s.float()[:, None])[ids])
    q4, sz = quantize_int4(w, 32)
    expected = (q4.float() - 8) * sz[0, :, 0].float()[:, None] + sz[0, :, 1].float()[:, None]
    assert torch.equal(Int4Linear.from_float(w).rows(ids), expected[ids])


def test_swap_linears_keeps_shared_modules_shared():
    mlp = GatedMLP(16, 24, "gelu_tanh")
    mlp.tied = mlp.gate_up_proj  # a second name for one module, as a tied LM head is
    swap_linears(mlp, "int8")
    assert isinstance(mlp.gate_up_proj, Int8Linear) and mlp.tied is mlp.gate_up_proj
    assert module_batch_invariant(mlp)
    swap_linears(mlp, "fp32")
    assert isinstance(mlp.down_proj, Float32Linear) and not module_batch_invariant(mlp)


def test_dtype_names():
    assert canonical_dtype("bf16") == "bfloat16" and canonical_dtype("fp32") == "float32"
    assert linear_class("int8") is Int8Linear and linear_class("i4") is Int4Linear
    assert rows_per_forward("bfloat16") == 64 and rows_per_forward("int8") == 64
    with pytest.raises(UnknownWeightDtype, match="int8"):
        canonical_dtype("fp8")


# --- kv cache + attention -------------------------------------------------------------------

def _naive_attention(q, k, v, q_positions, scaling, window=None):
    """q [n, H, Dh], k/v [T, Hkv, Dh] for positions 0..T-1: plain masked softmax attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,thd->nht", q, k) * scaling
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= q_positions[:, None] - key_pos[None, :] < window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nht,thd->nhd", torch.softmax(scores, -1), v)


@pytest.fixture
def two_threads():
    """The engine's 2 intra-op threads: MKL's one-item bmm kernel differs only when threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("H, Hkv", [(4, 2), (6, 3), (3, 1), (7, 1), (14, 2)])
def test_attention_matches_naive_and_is_batch_invariant(ring, H, Hkv, two_threads):
    # one row batches its KV heads in one bmm, n rows loop over them: the same bits per row.
    # (7, 1): a one-item bmm would round otherwise (MKL, g = 5..11); (14, 2): Qwen2.5 0.5B's heads
    Dh, T, window = 64, 40, 6
    k, v = torch.randn(T, Hkv, Dh, generator=_gen()), torch.randn(T, Hkv, Dh, generator=_gen(1))
    q = torch.randn(T, H, Dh, generator=_gen(2))
    if ring:
        cache = RingKVCache(Hkv, Dh, window=window, max_rows=9, key_block=8)
    else:
        cache = PagedKVCache(Hkv, Dh, key_block=8, max_positions=64)
        cache.ensure_capacity(T)
    sliding = window if ring else None
    start = 28  # rows 28..36 straddle the key block at 32; the ring (14 slots) has wrapped
    for p in range(0, start, 7):
        cache.write(p, k[p:p + 7], v[p:p + 7])
    cache.write(start, k[start:start + 9], v[start:start + 9])
    rows = attend(q[start:start + 9], cache, start, scaling=0.3, sliding_window=sliding)
    expected = _naive_attention(q[start:start + 9], k[:start + 9], v[:start + 9], torch.arange(start, start + 9),
                                0.3, sliding)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0)
    for i in range(9):  # each row alone, as a one-row decode after a rewind would compute it
        alone = attend(q[start + i:start + i + 1], cache, start + i, scaling=0.3, sliding_window=sliding)
        assert torch.equal(alone[0], rows[i])


@pytest.mark.parametrize("n", [1, 5])
def test_layers_sharing_a_mask_memo_attend_as_alone(n):
    # attend_rows keeps one mask per forward for every layer whose cache has the same mask_key:
    # rings fed the same writes and rollbacks (as a sequence's layers are) must agree with
    # masks built per layer
    Hkv, Dh, window = 1, 8, 6
    rings = [RingKVCache(Hkv, Dh, window=window, max_rows=5, key_block=8) for _ in range(2)]
    sequence = SequenceState(rings)
    kv = torch.randn(40, Hkv, Dh, generator=_gen(3))
    for _ in range(6):  # 5-row verifies keeping 3 rows: rejected rows leave stale, masked slots
        start = sequence.begin(5, verify=True)
        for ring in rings:
            ring.write(start, kv[start:start + 5], kv[start:start + 5])
        sequence.seq_len += 5
        sequence.keep(3)
    start = sequence.begin(n, verify=False)
    q = torch.randn(n, 2, Dh, generator=_gen(4))
    masks = {}
    for ring in rings:
        ring.write(start, kv[start:start + n], kv[start:start + n])
        shared = attend(q, ring, start, scaling=0.3, sliding_window=window, masks=masks)
        assert torch.equal(shared, attend(q, ring, start, scaling=0.3, sliding_window=window))
    assert len(masks) == 1


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("H, Hkv", [(4, 2), (9, 3), (7, 1), (14, 2)])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_decodes_of_several_sequences_attend_as_alone(ring, H, Hkv, kernel, two_threads, monkeypatch):
    # attend_rows runs the rows of every sequence of a forward together (one kernel call):
    # each sequence's rows must be bitwise what it computes alone.
    # Five sequences: three decode in one key block, one in the next, one runs three rows.
    from verispec.kernels import ckernels
    from verispec.nn.attention import attend_rows
    from verispec.nn.trunk import Rows, RowsOfSequence
    if not kernel:
        monkeypatch.setattr(ckernels, "library", lambda: None)
    elif ckernels.library() is None:
        pytest.skip("no C compiler: the C kernels are not built")
    Dh, window = 16, 6
    lengths, widths = [17, 20, 23, 26, 19], [1, 1, 1, 1, 3]
    states, q_rows, k_rows, v_rows, parts, begin = [], [], [], [], [], 0
    for i, (length, width) in enumerate(zip(lengths, widths)):
        if ring:
            cache = RingKVCache(Hkv, Dh, window=window, max_rows=4, key_block=8)
        else:
            cache = PagedKVCache(Hkv, Dh, key_block=8, max_positions=64)
            cache.ensure_capacity(length + width)
        for p in range(0, length, 4):
            n = min(4, length - p)
            cache.write(p, torch.randn(n, Hkv, Dh, generator=_gen(10 + i + p)),
                        torch.randn(n, Hkv, Dh, generator=_gen(50 + i + p)))
        state = SequenceState([cache])
        state.seq_len = length
        states.append(state)
        q_rows.append(torch.randn(width, H, Dh, generator=_gen(100 + i)))
        k_rows.append(torch.randn(width, Hkv, Dh, generator=_gen(200 + i)))
        v_rows.append(torch.randn(width, Hkv, Dh, generator=_gen(300 + i)))
        parts.append(RowsOfSequence(state, length, begin, begin + width))
        begin += width
    assert len({states[i].layers[0].key_length(lengths[i]) for i in range(3)}) == 1  # one group of three
    sliding = window if ring else None
    rows = Rows(torch.zeros(begin, dtype=torch.long), torch.zeros(begin, dtype=torch.long), tuple(parts))
    batched = attend_rows(torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), rows, 0, scaling=0.3,
                          sliding_window=sliding)
    for part, q in zip(parts, q_rows):  # k = None: read the K/V the batched call wrote
        single = Rows(torch.zeros(len(q), dtype=torch.long), torch.zeros(len(q), dtype=torch.long),
                      (RowsOfSequence(part.state, part.start_pos, 0, len(q)),))
        alone = attend_rows(q, None, None, single, 0, scaling=0.3, sliding_window=sliding)
        assert torch.equal(batched[part.rows], alone)
        reference = attend(q, part.state.layers[0], part.start_pos, scaling=0.3, sliding_window=sliding)
        torch.testing.assert_close(alone, reference, atol=2e-6, rtol=0)


def test_ring_refuses_a_truncation_it_cannot_serve():
    ring = RingKVCache(1, 4, window=6, max_rows=4)  # 9 slots
    sequence = SequenceState([ring, PagedKVCache(1, 4, max_positions=64), None])
    sequence.begin(30, verify=False)
    for p in range(30):
        for cache in sequence.layers[:2]:
            cache.write(p, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    sequence.seq_len = 30
    sequence.truncate(26)  # keeps 21..29; a query at 26 needs 21..25
    with pytest.raises(RewindBeyondWindow) as refused:
        sequence.truncate(25)  # needs 20, already overwritten by 29
    assert isinstance(refused.value, CannotTruncate)
    assert (refused.value.oldest_needed, refused.value.oldest_kept) == (20, 21)
    assert sequence.seq_len == 26
    with pytest.raises(ValueError, match="holds 26"):
        sequence.truncate(27)
    sequence.truncate(0)
    assert sequence.seq_len == 0 and (ring.tags == -1).all() and ring.high_water == -1


def test_ring_keep_refuses_a_verify_wider_than_its_slack():
    """A ring sized for 4-row forwards cannot undo a 5-row verify: keep says so instead of
    leaving a corrupted window."""
    ring = RingKVCache(1, 4, window=6, max_rows=4)  # 9 slots
    sequence = SequenceState([ring])
    sequence.begin(10, verify=False)
    ring.write(0, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))
    ring.write(4, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))
    ring.write(8, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    sequence.seq_len = 10
    sequence.begin(4, verify=True)  # as wide as the slack: every kept count works
    ring.write(10, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))
    sequence.seq_len = 14
    sequence.keep(0)
    sequence.begin(5, verify=True)
    ring.write(10, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))
    ring.write(14, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    sequence.seq_len = 15
    with pytest.raises(RewindBeyondWindow):
        sequence.keep(0)


def test_paged_cache_grows_by_blocks_and_keeps_its_rows():
    cache = PagedKVCache(2, 4, key_block=16, max_positions=100)
    cache.ensure_capacity(5)
    assert cache.capacity == 16
    cache.write(0, torch.ones(5, 2, 4), torch.ones(5, 2, 4))
    cache.ensure_capacity(40)
    assert cache.capacity == 48 and len(cache.k_blocks) == 3
    assert torch.equal(cache.read(5)[0], torch.ones(2, 5, 4))
    cache.ensure_capacity(100)
    assert cache.capacity == 112  # capped at max_positions rounded up to the block
    assert cache.key_length(0) == 16 and cache.key_length(16) == 32


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_rows_are_bitwise_whatever_the_batch(activation):
    """Width 37: without per-row padding ATen's SIMD tail moves with n and rows change by an ulp."""
    from verispec.nn.elementwise import rowwise

    mlp = GatedMLP(16, 37, activation)
    swap_linears(mlp, "int8")  # batch-invariant linears, so only the activation is on trial
    x = torch.randn(12, 16, generator=_gen())
    alone = torch.cat([mlp(x[i:i + 1]) for i in range(12)])
    for n in range(2, 13):
        assert torch.equal(mlp(x[:n]), alone[:n]), f"n={n}"
    h = torch.randn(12, 37, generator=_gen(1))
    assert any(not torch.equal(mlp.act_fn(h[:n]), torch.cat([mlp.act_fn(h[i:i + 1]) for i in range(n)]))
               for n in range(2, 13))  # the premise: unpadded, some batch differs
    torch.testing.assert_close(rowwise(mlp.act_fn, h), mlp.act_fn(h), atol=1e-6, rtol=1e-6)  # an ulp at most


@pytest.mark.parametrize("dtype", ["int8", "int4", "float32", "bfloat16"])
def test_a_fused_linear_is_bitwise_its_parts_concatenated(dtype):
    """q|k|v (unequal parts) and gate|up stacked along rows: every dtype quantises per output row,
    so the stacked linear holds the parts' values and gives bitwise their outputs, at any n."""
    d = 128
    for rows in ((128, 32, 32), (192, 192)):
        parts = [torch.randn(r, d, generator=_gen(r)) for r in rows]
        cls = linear_class(dtype)
        fused, alone = cls.from_float(torch.cat(parts)), [cls.from_float(w) for w in parts]
        stored = torch.cat([m.rows(torch.arange(m.out_features)) for m in alone])
        assert torch.equal(fused.rows(torch.arange(sum(rows))), stored)  # the same weights
        if dtype not in ("int8", "int4"):
            continue  # fp32 / bf16 matmuls may block a wider output another way: values, not bits
        x = torch.randn(9, d, generator=_gen(2))
        for n in range(1, 10):
            assert torch.equal(fused(x[:n]), torch.cat([m(x[:n]) for m in alone], dim=-1)), (rows, n)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_gated_mlp_is_bitwise_separate_gate_and_up_linears(dtype):
    from verispec.nn.elementwise import rowwise

    mlp = GatedMLP(64, 128, "silu")
    assert mlp.part_rows == {"gate_up_proj": (128, 128)}
    weight = mlp.gate_up_proj.weight.detach().clone()
    gate, up = (linear_class(dtype).from_float(w) for w in (weight[:128], weight[128:]))
    swap_linears(mlp, dtype)
    x = torch.randn(9, 64, generator=_gen())
    for n in range(1, 10):
        expected = mlp.down_proj(rowwise(torch.nn.functional.silu, gate(x[:n])) * up(x[:n]))
        assert torch.equal(mlp(x[:n]), expected), n


def test_gated_mlp():
    mlp = GatedMLP(8, 12, "silu")
    x = torch.randn(3, 8, generator=_gen())
    gate, up = mlp.gate_up_proj.weight.split(12)  # gate rows first
    expected = mlp.down_proj(torch.nn.functional.silu(x @ gate.T) * (x @ up.T))
    # the formula, not the bits: fp32 MKL may block the padded-row matmul another way under load
    torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="gelu_tanh"):
        GatedMLP(8, 12, "relu")
    assert math.isclose(GatedMLP(8, 12, "gelu_tanh").act_fn(torch.tensor(1.0)).item(), 0.8411920071, rel_tol=1e-6)
