"""fp32 parity with transformers: tiny random glm4_moe -> GGUF -> our loader.

Covers GQA with q/k/v biases, per-head q/k norms (and none), partial NeoX RoPE (10 of 20 dims),
dense leading layers, sigmoid-routed MoE with the selection bias, expert groups, two shared
experts, normalised and unnormalised weights, the routed scaling factor, tied and untied heads,
and a file whose last block is a NextN block (never run as a trunk layer: transformers' trunk has
only the 3 trunk layers). Logits of a 64-row prefill, then 16 one-row decodes.

Tolerance: max |Δlogit| <= 1e-4 (logits up to ~10; measured <= 2e-5).
"""
import pytest
import torch
from verispec.testing import forward_one
from verispec.testing.hf_parity import assert_logits_match_transformers, random_tokens
from verispec_glm5.loader import load

pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.mark.parametrize("name", ["nextn", "grouped"])
def test_prefill_and_decode_logits_match_transformers(tiny_fixture, name):
    hf_model, _, path = tiny_fixture(name)
    ours = load(path, dtype="float32")
    assert ours.num_layers == hf_model.config.num_hidden_layers
    prompt, continuation = random_tokens(hf_model.config.vocab_size, 64, 16)
    assert_logits_match_transformers(ours, hf_model, prompt, continuation, atol=ATOL)


def test_prefill_split_into_chunks_matches_transformers(tiny_fixture):
    hf_model, _, path = tiny_fixture("grouped")
    ours = load(path, dtype="float32", max_rows_per_forward=7)  # 40 rows -> 7, 7, 7, 7, 7, 5
    prompt = torch.randint(0, hf_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0]
    got = forward_one(ours, ours.new_sequence(), prompt.tolist()).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["nextn", "grouped"])
def test_hidden_rows_and_taps_match_transformers(tiny_fixture, name):
    """Final-normed rows (what the NextN head reads) and the residual entering each layer
    (`Segment.tap_layers`) equal transformers' hidden_states, batched beside a second sequence."""
    from verispec.seams import Segment

    hf_model, _, path = tiny_fixture(name)
    ours = load(path, dtype="float32")
    prompt = torch.randint(0, hf_model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    layers = tuple(range(ours.num_layers))
    with torch.no_grad():
        states = hf_model.model(prompt[None], output_hidden_states=True).hidden_states
    normed, taps, _ = ours.forward([
        Segment(ours.new_sequence(), prompt, logits="none", hidden=True),
        Segment(ours.new_sequence(), prompt, logits="none", hidden=True, tap_layers=layers),
        Segment(ours.new_sequence(), prompt[:5], logits="last")])
    torch.testing.assert_close(normed.hidden, states[-1][0], atol=ATOL, rtol=0)
    expected = torch.cat([states[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(taps.hidden, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["nextn", "grouped"])
def test_router_chooses_transformers_experts(tiny_fixture, name):
    """Per row, the experts and weights of core's TopkRouter (one row at a time) are transformers'
    Glm4MoeTopkRouter's (batched), on 200 random rows; the grouped config's group stage changes
    the choice for some rows (it is exercised, not vacuous)."""
    hf_model, _, path = tiny_fixture(name)
    ours = load(path, dtype="float32")
    hf_gate, our_gate = hf_model.model.layers[-1].mlp.gate, ours.model.layers[-1].mlp.gate
    x = torch.randn(200, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_gate(x)
        ids, weights = our_gate(x)
    order = hf_ids.sort(dim=-1)
    mine = ids.sort(dim=-1)
    assert torch.equal(mine.values, order.values)
    torch.testing.assert_close(weights.gather(1, mine.indices), hf_weights.gather(1, order.indices),
                               atol=1e-6, rtol=0)
    if our_gate.n_group > 1:
        ungrouped = torch.topk(torch.sigmoid(x @ our_gate.weight.T) + our_gate.e_score_correction_bias,
                               our_gate.top_k).indices.sort(dim=-1).values
        assert (ungrouped != mine.values).any(dim=-1).sum() > 10
