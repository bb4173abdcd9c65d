"""fp32 parity with transformers: tiny random qwen3_5 / qwen3_5_moe -> GGUF -> our loader.

Covers GDN layers (re-tiled value heads, -exp(A_log), plain ssm_norm), gated attention with
partial RoPE, dense SwiGLU, MoE with separate and fused expert tensors and a 1-D / 2-D shared
expert gate, tied and untied heads; logits of a 64-row prefill, then 16 one-row decodes.

Tolerance: max |Δlogit| <= 1e-4 (logits up to ~30). transformers itself runs prefill through
its chunked delta rule and decode through the recurrent one; those two differ from each other
by up to ~5e-4 on an 8-layer variant of these configs, so the fixtures keep 4 layers.
"""
import pytest
import torch
from verispec.testing import forward_one
from verispec.testing.hf_parity import assert_logits_match_transformers, random_tokens
from verispec_qwen35.loader import load

pytest.importorskip("transformers")

PARITY_CONFIGS = ["dense", "dense_tied", "moe", "moe_fused_mtp"]
ATOL = 1e-4


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_prefill_and_decode_logits_match_transformers(tiny_fixture, name):
    hf_model, _, path = tiny_fixture(name)
    prompt, continuation = random_tokens(hf_model.config.vocab_size, 64, 16)
    assert_logits_match_transformers(load(path, dtype="float32"), hf_model, prompt, continuation, atol=ATOL)


def test_prefill_split_into_chunks_matches_transformers(tiny_fixture):
    """A prefill longer than the forward chunk carries the recurrent state across chunks."""
    hf_model, _, path = tiny_fixture("moe")
    ours = load(path, dtype="float32")
    ours.max_rows_per_forward = 7  # 40 rows -> 7, 7, 7, 7, 7, 5
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, hf_model.config.vocab_size, (40,), generator=g).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = forward_one(ours, ours.new_sequence(), prompt).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_hidden_rows_are_the_final_normed_residual(tiny_fixture):
    hf_model, _, path = tiny_fixture("dense")
    ours = load(path, dtype="float32")
    prompt = [5, 9, 17, 33, 2, 64, 100, 3]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    out = forward_one(ours, ours.new_sequence(), prompt, logits="last", hidden=True)
    torch.testing.assert_close(out.hidden, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_hidden_taps_match_transformers_hidden_states(tiny_fixture, name):
    """`Segment.tap_layers` (what a DFlash drafter reads): the residual entering each layer, GDN and
    attention layers alike, as transformers' hidden_states[i], fp32; batched with a second sequence."""
    from verispec.seams import Segment

    hf_model, _, path = tiny_fixture(name)
    ours = load(path, dtype="float32")
    prompt = torch.randint(0, hf_model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    layers = tuple(range(ours.num_layers))
    out, _ = ours.forward([Segment(ours.new_sequence(), prompt, logits="none", hidden=True, tap_layers=layers),
                           Segment(ours.new_sequence(), prompt[:5], logits="last")])
    with torch.no_grad():
        states = hf_model.model(prompt[None], output_hidden_states=True).hidden_states
    # the residual stream entering a deep layer is larger than a logit row: one torch thread's
    # accumulation order (the workspace's one-thread fixture) leaves 1.1e-4 there, so twice ATOL
    torch.testing.assert_close(out.hidden, torch.cat([states[i][0] for i in layers], dim=-1), atol=2 * ATOL, rtol=0)
