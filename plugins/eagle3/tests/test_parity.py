"""The head's draft logits against `tiny_eagle3.reference_logits` (llama.cpp's eagle3 graph in plain
PyTorch, recomputed from scratch), fp32, on the tiny llama trunk's real taps: a first round after the
prompt (catch-up rows + the fc step + chained steps), then a second round after a verify kept two
rows (keep dropped the chained rows; the committed ones were rebuilt from the trunk's taps)."""
from __future__ import annotations

import pytest
import torch
from tiny_eagle3 import (HF_TO_GGUF, TAPS, TARGET, _rope_neox, convert_like_llama_cpp, head_tensors, hf_checkpoint,
                         reference_logits, write_head)
from verispec.seams import Segment
from verispec_eagle3.loader import load

PROMPT = [5, 17, 33, 2, 90, 41, 41, 8, 63]
#: name -> (head_tensors kwargs, writer kwargs)
VARIANTS = {
    "own_output_d2t": ({}, {}),
    "borrowed_tables_no_d2t": ({"draft_vocab": None, "own_output": False}, {}),
    "own_tables_norms_ropefreqs": ({"own_embedding": True, "norm_before_fc": True, "rope_freqs": True},
                                   {"norm_before_residual": True, "norm_before_fc": True}),
}


def _taps(trunk, seq, tokens):
    return trunk.forward([Segment(seq, tokens, logits="none", hidden=True, tap_layers=TAPS)])[0].hidden


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_draft_logits_equal_the_reference(target, tmp_path, variant):
    _, _, trunk = target
    kwargs, flags = VARIANTS[variant]
    tensors, d2t = head_tensors(seed=1, **kwargs)
    head = load(write_head(tmp_path / "head.gguf", tensors, d2t, **flags), trunk)
    view = trunk.view()
    embed = (lambda ids: tensors["token_embd.weight"][ids]) if "token_embd.weight" in tensors else view.embed
    lm_head = (lambda rows: rows @ tensors["output.weight"].T) if "output.weight" in tensors else view.logits

    def reference(taps, tokens, drafts):
        return reference_logits(tensors, d2t, embed=embed, lm_head=lm_head, taps=taps, tokens=tokens, drafts=drafts,
                                vocab=TARGET["vocab_size"],
                                norm_before_residual=flags.get("norm_before_residual", False),
                                norm_before_fc=flags.get("norm_before_fc", False))

    def chain(state, token, taps_prev, pos, steps):
        rows, drafts, hidden = [], [], taps_prev
        for j in range(steps):
            logits, hidden = head.draft_step(state, token, hidden, pos + j)
            rows.append(logits)
            token = int(logits.argmax())
            drafts.append(token)
        return torch.stack(rows), drafts

    seq, state = trunk.new_sequence(), head.new_state()
    taps = _taps(trunk, seq, PROMPT)
    head.draft_catch_up(state, PROMPT, taps, 0)
    pending = 77
    got, drafts = chain(state, pending, taps[-1], len(PROMPT), 4)
    want = reference(taps, PROMPT + [pending], drafts[:-1])
    _assert_logits(got, want, d2t)

    # the verify of [pending, d1, d2, d3] kept 2 rows: keep, then commit with the trunk's own taps
    head.keep(state, 2)
    kept = [pending, drafts[0]]
    more = _taps(trunk, seq, kept)
    head.draft_catch_up(state, kept, more, len(PROMPT))
    bonus = 12
    got2, drafts2 = chain(state, bonus, more[-1], len(PROMPT) + 2, 3)
    want2 = reference(torch.cat([taps, more]), PROMPT + kept + [bonus], drafts2[:-1])
    _assert_logits(got2, want2, d2t)
    assert state.kv.held() == list(range(len(PROMPT) + 2 + 2))  # committed rows + this round's 3, not stale ones


def _assert_logits(got, want, d2t):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)  # -inf exactly off the draft vocabulary
    if d2t is not None:
        assert int(finite[0].sum()) == d2t.numel()
    torch.testing.assert_close(got[finite], want[finite], atol=2e-5, rtol=1e-5)


def test_taps_are_the_inputs_of_the_target_layers(target):
    """llama.cpp extracts eagle3 features at a layer's INPUT (src/models/llama.cpp: cb(inpL, ...) before
    layer il): transformers' hidden_states[L] (hidden_states[0] = the embeddings). Our trunk's
    Segment.tap_layers rows are those, in the file's order."""
    hf, _, trunk = target
    seq = trunk.new_sequence()
    got = _taps(trunk, seq, PROMPT)
    with torch.no_grad():
        states = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    want = torch.cat([states[L][0] for L in TAPS], dim=-1)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_a_converted_hf_checkpoint_equals_the_hf_graph(target, tmp_path):
    """A file as llama.cpp's converter writes it from an HF EAGLE-3 checkpoint (q/k rows permuted for
    NORM RoPE, d2t offsets made absolute) drafts what the HF graph computes on the unpermuted weights
    with rotate-half RoPE and d2t offsets (SafeAILab's Eagle3 midlayer: the residual is the raw g)."""
    _, _, trunk = target
    state, offsets = hf_checkpoint()
    tensors, d2t = convert_like_llama_cpp(state, offsets)
    head = load(write_head(tmp_path / "converted.gguf", tensors, d2t), trunk)
    seq, head_state = trunk.new_sequence(), head.new_state()
    taps = _taps(trunk, seq, PROMPT)
    head.draft_catch_up(head_state, PROMPT, taps, 0)
    rows, drafts, hidden, token = [], [], taps[-1], 77
    for j in range(3):
        logits, hidden = head.draft_step(head_state, token, hidden, len(PROMPT) + j)
        rows.append(logits)
        token = int(logits.argmax())
        drafts.append(token)
    hf_named = {gguf: state[hf] for hf, gguf in HF_TO_GGUF.items()}  # unpermuted, for the reference's indexing
    want = reference_logits(hf_named, offsets + torch.arange(offsets.numel()), embed=trunk.view().embed,
                            lm_head=lambda r: r @ state["lm_head.weight"].T, taps=taps, tokens=PROMPT + [77],
                            drafts=drafts[:-1], vocab=TARGET["vocab_size"], rope=_rope_neox)
    _assert_logits(torch.stack(rows), want, d2t)
    assert not torch.equal(tensors["blk.0.attn_q.weight"], state["midlayer.self_attn.q_proj.weight"])  # permuted


def test_a_q8_0_head_drafts_its_dequantised_numbers(target, tmp_path):
    """llama.cpp users quantise heads (`llama-quantize ... Q8_0`; d2t stays I64): such a file loads, and
    its drafts are the reference's over the file's dequantised values (gguf-py's dequantisation)."""
    from verispec.gguf.io import GGUFFile

    _, _, trunk = target
    tensors, d2t = head_tensors(seed=4)
    q8 = {n: "Q8_0" for n, t in tensors.items() if t.dim() == 2 and t.shape[1] % 32 == 0}
    assert "blk.0.attn_q.weight" in q8 and "blk.0.ffn_gate.weight" not in q8  # 96 = 2·48 columns; 48 are not blocks
    path = write_head(tmp_path / "q8.gguf", tensors, d2t, tensor_types=q8)
    gguf = GGUFFile.open(path)
    assert gguf.tensor_info("blk.0.attn_q.weight").ggml_type.name == "Q8_0" and gguf.tensor("d2t").dtype == torch.int64
    stored = {name: gguf.tensor(name) for name in tensors}
    assert not torch.equal(stored["blk.0.attn_q.weight"], tensors["blk.0.attn_q.weight"])  # really quantised
    head = load(path, trunk)
    seq, state = trunk.new_sequence(), head.new_state()
    taps = _taps(trunk, seq, PROMPT)
    head.draft_catch_up(state, PROMPT, taps, 0)
    logits, hidden = head.draft_step(state, 77, taps[-1], len(PROMPT))
    second, _ = head.draft_step(state, int(logits.argmax()), hidden, len(PROMPT) + 1)
    want = reference_logits(stored, d2t, embed=trunk.view().embed, lm_head=lambda r: r @ stored["output.weight"].T,
                            taps=taps, tokens=PROMPT + [77], drafts=[int(logits.argmax())], vocab=TARGET["vocab_size"])
    _assert_logits(torch.stack([logits, second]), want, d2t)
