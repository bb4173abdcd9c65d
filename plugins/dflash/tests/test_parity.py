"""Exactness against the reference (`dflash==0.1.0`): tiny random DFlash1/DFlash2 drafters built in
`dflash.model`, written to GGUF by `gguf_writer` (llama.cpp names, +1 taps), loaded by our loader.

The oracle is the reference's full-recompute forward: `model(target_hidden=[1, s, T·H] of every
committed row, noise_embedding=E[anchor, mask…], position_ids=0..s+n-1)`, its `compute_logits`
through the target's own transformers LM head, and argmax / `propose` (the DFlash2 walk). Ours is
the head driven step by step through its rings with random accept counts (rollbacks), in both
orders a caller may use: commit the kept rows after `keep` (the loop's), or inject the whole verify
(rejected rows with junk taps) and then `keep`.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from tiny_dflash import MASK_ID, TARGET, VARIANTS

pytest.importorskip("dflash.model", reason="the reference oracle: pip install --no-deps dflash==0.1.0")

from verispec_dflash.conv import grouped_conv  # noqa: E402
from verispec_dflash.loader import load  # noqa: E402
from verispec_dflash.selector import walk_drafts  # noqa: E402

H = TARGET["hidden_size"]
STEPS = 36  # per variant: 7 variants -> 252 random steps


@torch.no_grad()
def reference_block(ref, hf, features, s, ids):
    """(z [n, H], logits [n-1, V], drafts) of the reference's full recompute at anchor position s."""
    from dflash.model import DFlash2DraftModel

    scale = float(ref.config.dflash_config.get("input_embedding_scale", 1.0))
    emb = hf.model.embed_tokens(ids)[None] * scale
    z = ref(target_hidden=features[None, :s], noise_embedding=emb, position_ids=torch.arange(s + len(ids))[None])[0]
    logits = ref.compute_logits(z[1:], hf.lm_head)
    if isinstance(ref, DFlash2DraftModel):
        drafts = ref.propose(z[None, 1:], ids[:1], hf.lm_head, 0.0)[0][0]
    else:
        drafts = logits.argmax(-1)
    return z, logits, drafts.tolist()


def _check_block(head, state, ref, hf, features, s, anchor, n, what):
    ids = torch.tensor([anchor] + [MASK_ID] * (n - 1))
    z, logits = head.block_logits(state, anchor, s, n)
    z_ref, logits_ref, drafts_ref = reference_block(ref, hf, features, s, ids)
    torch.testing.assert_close(z, z_ref, atol=1e-5, rtol=0, msg=lambda m: f"{what}: block hidden {m}")
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: logits {m}")
    drafts, cumulative = head.draft_block(state, anchor, None, s, num_rows=n)
    assert drafts == drafts_ref, f"{what}: drafts {drafts} != reference {drafts_ref}"
    assert all(a >= b for a, b in zip(cumulative, cumulative[1:])) and 0 < cumulative[0] <= 1
    return drafts, cumulative, logits


def _fresh_equals(head, state, length, features, anchor, what):
    """A fresh state fed the committed rows in one call sees the same rows: same Pass C output."""
    fresh = head.new_state()
    head.draft_catch_up(fresh, [0] * length, features[:length], 0)
    n = head.draft_block_size
    z, _ = head.block_logits(state, anchor, length, n)
    z_fresh, _ = head.block_logits(fresh, anchor, length, n)
    torch.testing.assert_close(z, z_fresh, atol=1e-5, rtol=0, msg=lambda m: f"{what}: ring vs fresh ring {m}")
    for ring, fresh_ring in zip(state.rings, fresh.rings):
        k, v, mask = ring.visible(length, n)
        kf, vf, maskf = fresh_ring.visible(length, n)
        seen, seen_fresh = mask.any(0), maskf.any(0)
        assert int(seen.sum()) == int(seen_fresh.sum()), f"{what}: visible rows differ"
        torch.testing.assert_close(k[seen], kf[seen_fresh], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_random_steps_with_rollbacks_match_the_reference(variant, target, drafter_file):
    hf, _, trunk = target
    ref, path = drafter_file(variant)
    head = load(path, trunk)
    assert head.config.generation == (2 if "d2" in variant else 1)
    g = torch.Generator().manual_seed(zlib.crc32(variant.encode()))  # not hash(): salted per process
    T = len(head.tap_layers)
    features = torch.randn(400, T * H, generator=g)
    state = head.new_state()
    s = int(torch.randint(3, 12, (1,), generator=g))
    head.draft_catch_up(state, [0] * s, features[:s], 0)
    for step in range(STEPS):
        n = int(torch.randint(2, head.draft_block_size + 1, (1,), generator=g))
        anchor = int(torch.randint(0, MASK_ID, (1,), generator=g))
        what = f"{variant} step {step} (s={s}, n={n})"
        _check_block(head, state, ref, hf, features, s, anchor, n, what)
        kept = int(torch.randint(1, n + 1, (1,), generator=g))  # anchor + accepted drafts
        if step % 2:  # the loop's order: keep, then commit the kept rows
            head.keep(state, kept)
            head.draft_catch_up(state, [0] * kept, features[s:s + kept], s)
        else:  # inject the whole verify (junk taps past the kept rows), then keep
            rows = torch.cat([features[s:s + kept], torch.randn(n - kept, T * H, generator=g)])
            head.draft_catch_up(state, [0] * n, rows, s)
            head.keep(state, kept)
        s += kept
        if step % 6 == 5:
            _fresh_equals(head, state, s, features, anchor, what)


def test_deferred_rows_match_rows_injected_at_once(target, drafter_file):
    """Rows committed one at a time while no block is drafted (a parked head: past MAX_PENDING_ROWS,
    across a gap, with a rewind into the pending rows) give the block of one call over the same rows."""
    from verispec_dflash.head import MAX_PENDING_ROWS

    _, _, trunk = target
    for variant in ("d1_causal_window", "d2_noncausal"):
        _, path = drafter_file(variant)
        head = load(path, trunk)
        n_rows = MAX_PENDING_ROWS + 40
        features = torch.randn(n_rows, len(head.tap_layers) * H, generator=torch.Generator().manual_seed(4))
        state = head.new_state()
        for p in range(n_rows - 10):
            head.draft_catch_up(state, [0], features[p:p + 1], p)
        assert 0 < len(state.pending) < MAX_PENDING_ROWS  # one batched flush happened, rows wait again
        head.draft_catch_up(state, [0] * 10, torch.randn(10, features.shape[1]), n_rows - 10)  # junk, then
        head.rewind(state, n_rows - 10)                                                      # rewound away
        head.draft_catch_up(state, [0] * 10, features[n_rows - 10:], n_rows - 10)
        fresh = head.new_state()
        head.draft_catch_up(fresh, [0] * n_rows, features, 0)
        torch.testing.assert_close(head.block_logits(state, 5, n_rows)[0], head.block_logits(fresh, 5, n_rows)[0],
                                   atol=1e-5, rtol=0, msg=lambda m, v=variant: f"{v}: deferred vs at once {m}")
        assert not state.pending

        gap = head.new_state()  # a reused prefix reaches the head without taps: a hole, then rows
        head.draft_catch_up(gap, [0] * 20, None, 0)
        head.draft_catch_up(gap, [0] * 30, features[20:50], 20)
        held = head.new_state()
        head.draft_catch_up(held, [0] * 30, features[20:50], 20)
        assert torch.equal(head.block_logits(gap, 5, 50)[0], head.block_logits(held, 5, 50)[0])


def test_identity_conv_reduces_to_dflash1(target, drafter_file):
    """An identity-initialised conv (base tap 0 = 1, else 0, projections 0) and P = 0: the DFlash2
    file runs as the DFlash1 reference holding its backbone weights, drafts = plain argmax."""
    from dflash.model import DFlashDraftModel

    hf, _, trunk = target
    ref2, path = drafter_file("d2_noncausal", identity_conv=True, zero_selector=True)
    ref1 = DFlashDraftModel(ref2.config).eval()
    backbone = {k: v for k, v in ref2.state_dict().items() if "conv" not in k and "selector" not in k}
    ref1.load_state_dict(backbone, strict=True)
    head = load(path, trunk)
    plain = load(path, trunk, use_conv=False, use_selector=False)
    g = torch.Generator().manual_seed(5)
    features = torch.randn(20, len(head.tap_layers) * H, generator=g)
    state, plain_state = head.new_state(), plain.new_state()
    head.draft_catch_up(state, [0] * 20, features, 0)
    plain.draft_catch_up(plain_state, [0] * 20, features, 0)
    ids = torch.tensor([7] + [MASK_ID] * 5)
    z_ref, logits_ref, drafts_ref = reference_block(ref1, hf, features, 20, ids)
    z, logits = head.block_logits(state, 7, 20, 6)
    torch.testing.assert_close(z, z_ref, atol=1e-5, rtol=0)
    assert head.draft_block(state, 7, None, 20)[0] == drafts_ref == plain.draft_block(plain_state, 7, None, 20)[0]


def test_a_live_conv_and_selector_change_the_drafter(target, drafter_file):
    """The switches matter on a random DFlash2 file (else the parity tests above could not see them)."""
    _, _, trunk = target
    _, path = drafter_file("d2_noncausal")
    head, plain = load(path, trunk), load(path, trunk, use_conv=False, use_selector=False)
    features = torch.randn(9, len(head.tap_layers) * H, generator=torch.Generator().manual_seed(2))
    a, b = head.new_state(), plain.new_state()
    head.draft_catch_up(a, [0] * 9, features, 0)
    plain.draft_catch_up(b, [0] * 9, features, 0)
    assert (head.block_logits(a, 3, 9)[0] - plain.block_logits(b, 3, 9)[0]).abs().max() > 1e-2


def test_window_independence(target, drafter_file):
    """Ring rows older than s-W+1 do not change a windowed drafter's block (note §8 test 4)."""
    _, _, trunk = target
    _, path = drafter_file("d1_causal_window")
    head = load(path, trunk)
    W = head.config.sliding_window
    features = torch.randn(30, len(head.tap_layers) * H, generator=torch.Generator().manual_seed(3))
    a, b = head.new_state(), head.new_state()
    head.draft_catch_up(a, [0] * 30, features, 0)
    noisy = features.clone()
    noisy[:30 - W + 1] = torch.randn(30 - W + 1, noisy.shape[1])
    head.draft_catch_up(b, [0] * 30, noisy, 0)
    assert torch.equal(head.block_logits(a, 4, 30)[0], head.block_logits(b, 4, 30)[0])
    noisy[30 - W + 1] += 1.0  # the oldest visible row does matter
    c = head.new_state()
    head.draft_catch_up(c, [0] * 30, noisy, 0)
    assert not torch.equal(head.block_logits(a, 4, 30)[0], head.block_logits(c, 4, 30)[0])


def test_conv_worked_example():
    """Reference note §8 example 5 (one side; n=3, H=4, gs=2, KS=2)."""
    x = torch.tensor([[1, 2, 3, 4], [0.5, -1, 2, 0], [1, 1, -1, 2]])
    base = torch.tensor([[1, 1, 1, 1], [0.5, 0.5, -0.5, -0.5]])
    delta = torch.tensor([[[0, 0], [9, 9]], [[0.1, -0.1], [0.2, 0]], [[0, 0], [-0.5, 1]]])
    y = grouped_conv(x, delta, base, 2)
    torch.testing.assert_close(y, torch.tensor([[1, 2, 3, 4], [1.25, 0.3, 0.3, -2], [1, 1, 0, 2]]))


def test_selector_worked_example():
    """Reference note §8 example 6: the greedy walk picks [1, 2] (independent argmax: [1, 0])."""
    A = torch.tensor([[1, 0], [0, 1], [1, 1], [0.5, -1], [2, 0]])
    B = torch.tensor([[0, 1], [1, 0], [1, -1], [0.5, 0.5], [-1, 2]])
    logits = torch.full((2, 5), -10.0)
    logits[0, 1], logits[0, 3], logits[1, 2], logits[1, 0] = 2.0, 1.8, 0.3, 0.5
    gamma = torch.tensor([[1, 0.5], [-1, -2]])
    ids, conf = walk_drafts(logits, gamma, 4, top_k=2, projection=torch.eye(2), predecessor=A, successor=B)
    assert ids == [1, 2]
    assert conf == pytest.approx([0.7685, 0.9781], abs=1e-4)
