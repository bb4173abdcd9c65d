"""A short training of the assistant on its tiny trunk's own greedy outputs makes the
gemma4-assistant speculator accept most drafts while the stream stays plain greedy's.

The head trains as transformers' Gemma4AssistantForCausalLM (autograd), on the target's
shared K/V and final-normed rows, then crosses the HF -> GGUF -> head path like any file.
Teacher forcing, one example per position p of every stream: (token p, hidden row p-1) over K/V
of positions < p, at query position p, predicts token p+1 (loss only on tokens the trunk
generated). Examples of different lengths share a batch by left-padding their K/V (the
assistant's sliding rule counts entries from the end). 16 streams of 40 greedy tokens, 250
Adam steps (about half a minute on one core).

What it shows and what not: acceptance is measured on the training prompts' own continuations
(a random tiny trunk's greedy streams are chaotic); the point is that a trained head drives the
loop to high acceptance with exact output, not generalisation.
"""
import pytest
import torch
from tiny_assistant import hf_target_outputs, write_assistant_gguf
from verispec.testing import run_greedy
from verispec_gemma4.loader import load as load_trunk
from verispec_gemma4_assistant.loader import load
from verispec_gemma4_assistant.speculator import AssistantSpeculator

pytest.importorskip("transformers")
NUM_STREAMS, PROMPT_LEN, NUM_GENERATED, NUM_STEPS = 16, 8, 40, 250


def _examples(target, trunk):
    g = torch.Generator().manual_seed(7)
    prompts, batch = [], {"embeds": [], "positions": [], "kv": [], "mask": [], "targets": [], "weight": []}
    for _ in range(NUM_STREAMS):
        prompt = torch.randint(0, trunk.vocab_size, (PROMPT_LEN,), generator=g).tolist()
        stream = torch.tensor(prompt + run_greedy(trunk, prompt, NUM_GENERATED)[0])
        prompts.append(prompt)
        out = hf_target_outputs(target, stream)
        hidden, embeds = out.hidden_states[-1][0], target.model.embed_tokens(stream[None])[0]
        t = len(stream)
        for p in range(1, t - 1):
            batch["embeds"].append(torch.cat([embeds[p], hidden[p - 1]]))
            batch["positions"].append(p)
            batch["kv"].append({kind: tuple(torch.cat([x.new_zeros(*x.shape[:2], t - p, x.shape[3]), x[:, :, :p]],
                                                      dim=2) for x in kv)
                                for kind, kv in out.shared_kv_states.items()})
            batch["mask"].append(torch.tensor([0] * (t - p) + [1] * p))
            batch["targets"].append(int(stream[p + 1]))
            batch["weight"].append(float(p + 1 >= PROMPT_LEN))
    kinds = batch["kv"][0].keys()
    kv = {kind: tuple(torch.cat([e[kind][i] for e in batch["kv"]]) for i in (0, 1)) for kind in kinds}
    return prompts, (torch.stack(batch["embeds"])[:, None], torch.tensor(batch["positions"])[:, None], kv,
                     torch.stack(batch["mask"]), torch.tensor(batch["targets"]), torch.tensor(batch["weight"]))


def _train(assistant, examples) -> float:
    embeds, positions, kv, mask, targets, weight = examples
    torch.manual_seed(0)
    assistant.train()
    optimizer = torch.optim.Adam(assistant.parameters(), lr=3e-3)
    for _ in range(NUM_STEPS):
        logits = assistant(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                           shared_kv_states=kv, use_cache=False).logits[:, 0]
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        loss = (losses * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assistant.eval()
    return loss.item()


def _acceptance(trunk, head, prompts, *, window):
    """(accepted / drafted over the prompts, every stream equal to plain greedy)."""
    accepted = drafted = 0
    exact = True
    for prompt in prompts:
        plain = run_greedy(trunk, prompt, NUM_GENERATED - 8)[0]
        speculator = AssistantSpeculator(head, max_draft_tokens=window, min_draft_prob=0.0)
        got, ex = run_greedy(trunk, prompt, NUM_GENERATED - 8, speculator, max_draft_tokens=window)
        exact &= got == plain
        accepted, drafted = accepted + ex.stats.num_accepted_tokens, drafted + ex.stats.num_draft_tokens
    return accepted / max(drafted, 1), exact


def test_trained_head_accepts_most_drafts_with_the_plain_stream(pair_files, tmp_path):
    target, assistant, trunk_path, assistant_path = pair_files("dense_31b_style")
    for p in target.parameters():
        p.requires_grad_(False)  # only the assistant trains
    trunk = load_trunk(trunk_path, dtype="float32", use_cache=False, tokenizer=False)
    prompts, examples = _examples(target, trunk)
    untrained = _acceptance(trunk, load(assistant_path, trunk, use_cache=False), prompts[:3], window=1)[0]

    import copy
    trained = copy.deepcopy(assistant)
    assert _train(trained, examples) < 0.3
    trained_path = write_assistant_gguf(tmp_path / "trained.gguf", trained, target, rope_freqs=False)
    head = load(trained_path, trunk, use_cache=False)
    acceptance, exact = _acceptance(trunk, head, prompts[:3], window=1)
    assert exact
    assert acceptance > 0.5 > untrained, (acceptance, untrained)
    chained, exact = _acceptance(trunk, head, prompts[:3], window=3)
    assert exact
    print(f"acceptance: untrained {untrained:.2f}, trained {acceptance:.2f} (window 1), {chained:.2f} (window 3)")
