"""A short training of the glm5-next NextN head on the tiny trunk's own greedy outputs makes `mtp`
speculation accept most drafts while the stream stays the plain greedy stream.

As test_glm_dsa_training.py: the head is trained as transformers' MtpLayer over a plain-residual
Glm5NextTextAttention + Glm5NextTextMoE layer (`tiny_glm5next.nextn_reference`, autograd; the
trunk frozen; the k-pool selection is not differentiable and is not trained), written back to
GGUF through the test map and loaded by the real loader. Teacher forcing: pair (h[j], t[j+1])
predicts t[j+2], loss only on targets the trunk generated. Acceptance is measured on the
training prompts' own continuations: the point is a trained head driving the loop to high
acceptance with exact output.
"""
import pytest
import tiny_glm5next
import torch
from verispec.testing import forward_one, run_greedy
from verispec_glm5.loader_glm5next import load

pytest.importorskip("transformers")
speculator_mod = pytest.importorskip("verispec_mtp_nextn.speculator")

NUM_STREAMS, PROMPT_LEN, NUM_GENERATED, NUM_STEPS = 12, 8, 40, 200


def _greedy_streams(trunk, vocab_size):
    g = torch.Generator().manual_seed(7)
    prompts, tokens, hidden = [], [], []
    for _ in range(NUM_STREAMS):
        prompt = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=g).tolist()
        stream = prompt + run_greedy(trunk, prompt, NUM_GENERATED)[0]
        seq = trunk.new_sequence()
        hidden.append(forward_one(trunk, seq, stream, logits="none", hidden=True).hidden)  # [T, D]
        trunk.release(seq)
        prompts.append(prompt)
        tokens.append(torch.tensor(stream))
    return prompts, torch.stack(tokens), torch.stack(hidden)


def _train(hf_model, tokens, hidden, vocab_size) -> float:
    torch.manual_seed(0)
    t = tokens.shape[1]
    inputs, rows, targets = tokens[:, 1:t - 1], hidden[:, :t - 2], tokens[:, 2:]
    weight = torch.zeros(t - 2)
    weight[PROMPT_LEN - 2:] = 1.0  # targets the trunk generated (the prompt is random)
    optimizer = torch.optim.Adam([p for p in hf_model.mtp.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(NUM_STEPS):
        logits, _ = tiny_glm5next.nextn_reference(hf_model, inputs, rows)
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                                                   reduction="none").view(len(tokens), -1)
        loss = (losses * weight).sum() / (weight.sum() * len(tokens))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def _acceptance(trunk, prompts, *, window):
    """(accepted / drafted over the prompts, every stream equal to plain greedy)."""
    accepted = drafted = 0
    exact = True
    for prompt in prompts:
        plain = run_greedy(trunk, prompt, NUM_GENERATED - 8)[0]
        speculator = speculator_mod.MtpSpeculator(trunk.draft_head, max_draft_tokens=window)
        got, ex = run_greedy(trunk, prompt, NUM_GENERATED - 8, speculator, max_draft_tokens=window)
        exact &= got == plain
        accepted, drafted = accepted + ex.stats.num_accepted_tokens, drafted + ex.stats.num_draft_tokens
    return accepted / max(drafted, 1), exact


def test_trained_head_accepts_most_drafts_with_the_plain_stream(tiny_glm5next_fixture, tmp_path):
    hf_model = tiny_glm5next.build_hf_model("flash")  # a fresh copy: the session's fixture stays untrained
    for name, p in hf_model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))  # only the head trains (embedding, LM head: the trunk's)
    vocab = hf_model.config.vocab_size
    trunk = load(tiny_glm5next_fixture("flash")[1], dtype="float32")
    prompts, tokens, hidden = _greedy_streams(trunk, vocab)
    assert tokens.shape[1] > hf_model.config.index_topk + hf_model.config.index_kpool  # pools selected
    untrained = _acceptance(trunk, prompts[:3], window=1)[0]

    hf_model.mtp.train()
    assert _train(hf_model, tokens, hidden, vocab) < 0.2
    hf_model.mtp.eval()
    trained = load(tiny_glm5next.write_fixture(hf_model, tmp_path / "trained.gguf"), dtype="float32")
    acceptance, exact = _acceptance(trained, prompts[:3], window=1)
    assert exact
    assert acceptance >= 0.5 > untrained, (acceptance, untrained)
    assert _acceptance(trained, prompts[:3], window=2)[1]  # chained drafts: still exact
