"""One draft step and a k-step chain against transformers 5.24 (Gemma4AssistantForCausalLM and its
SinglePositionMultiTokenCandidateGenerator) on two tiny random pairs: an E-style target (PLE, KV
sharing, centroid head) and a 31B-style one (K=V full layers with their own KV-head count).
Positions cross the sliding window (8) so the sliding layers' visibility rule is exercised."""
import pytest
import torch
from tiny_assistant import PAIRS, hf_step, hf_target_outputs
from tiny_gemma import token_ids
from verispec.testing import forward_one
from verispec_gemma4.loader import load as load_trunk
from verispec_gemma4_assistant.loader import load

pytest.importorskip("transformers")
ATOL = 1e-5


def _setup(pair_files, name, p, *, centroids=False):
    target, assistant, trunk_path, assistant_path = pair_files(name)
    trunk = load_trunk(trunk_path, dtype="float32", use_cache=False, tokenizer=False,
                       max_rows_per_forward=16, max_verify_rows=16)
    head = load(assistant_path, trunk, centroids=centroids, use_cache=False)
    ids = token_ids(p + 1, seed=4, vocab_size=trunk.vocab_size)
    seq = trunk.new_sequence()
    for start in range(0, p, 16):  # chunked prefill: the rings wrap
        hidden = forward_one(trunk, seq, ids[start:min(p, start + 16)], logits="none", hidden=True).hidden
    return target, assistant, trunk, head, seq, ids, hidden[-1]


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("p", [5, 9, 10, 37])
def test_one_step_matches_transformers(pair_files, name, p):
    centroids = PAIRS[name][1]  # transformers scores with the centroid head where the file has one
    target, assistant, trunk, head, seq, ids, _ = _setup(pair_files, name, p, centroids=centroids)
    outputs = hf_target_outputs(target, ids[:p])
    hf_hidden = outputs.hidden_states[-1][0, -1]
    want_logits, want_next = hf_step(assistant, target, outputs, int(ids[p]), hf_hidden, p)
    logits, h_next = head.step(head.read_kv(seq, p), int(ids[p]), hf_hidden, p)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(h_next, want_next, atol=ATOL, rtol=0)
    if centroids:  # the dense head scores the same tokens the same, and every other token too
        head.centroids = False
        dense, _ = head.step(head.read_kv(seq, p), int(ids[p]), hf_hidden, p)
        scored = want_logits > want_logits.min()
        assert 0 < int(scored.sum()) < len(scored)
        torch.testing.assert_close(dense[scored], want_logits[scored], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("p", [12, 40])
def test_a_chain_equals_the_candidate_generators_drafts(pair_files, name, p):
    """k steps at one position, each on the previous draft and h_next: transformers'
    SinglePositionMultiTokenCandidateGenerator drafts the same ids after the target's prefill."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    k = 6
    centroids = PAIRS[name][1]
    target, assistant, trunk, head, seq, ids, hidden = _setup(pair_files, name, p, centroids=centroids)
    assistant.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.model.embed_tokens,
                                                           GenerationConfig(max_length=512))
    candidates, _ = generator.get_candidates(ids[None, :p + 1], {"attention_mask": torch.ones(1, p + 1)},
                                             hf_target_outputs(target, ids[:p]), False, 0)
    kv = head.read_kv(seq, p)
    token, drafts = int(ids[p]), []
    for _ in range(k):
        logits, hidden = head.step(kv, token, hidden, p)
        token = int(logits.argmax())
        drafts.append(token)
    assert drafts == candidates[0, p + 1:].tolist()


@pytest.mark.parametrize("extra, matches", [(1, True), (0, False), (-1, False)])
def test_sliding_layers_see_the_last_window_plus_one_positions(pair_files, monkeypatch, extra, matches):
    """transformers' assistant sees the last W + 1 committed positions on sliding layers; the causal
    readings W and W - 1 differ measurably (docs/reference/gemma4.md §4.2)."""
    from verispec_gemma4_assistant import head as head_module

    p = 30
    monkeypatch.setattr(head_module, "SLIDING_EXTRA_POSITIONS", extra)
    target, assistant, trunk, head, seq, ids, _ = _setup(pair_files, "dense_31b_style", p)
    outputs = hf_target_outputs(target, ids[:p])
    hf_hidden = outputs.hidden_states[-1][0, -1]
    want, _ = hf_step(assistant, target, outputs, int(ids[p]), hf_hidden, p)
    kv = head.read_kv(seq, p)
    assert sum(int((p >= 0).sum()) for _, _, p in kv["sliding_attention"]) == trunk.config.sliding_window + extra
    got, _ = head.step(kv, int(ids[p]), hf_hidden, p)
    assert bool(torch.allclose(got, want, atol=ATOL, rtol=0)) == matches, (got - want).abs().max()
    if not matches:
        assert (got - want).abs().max() > 1e-3
