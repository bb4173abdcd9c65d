"""Our Gemma 4 trunk, loaded from a GGUF by the real loader, against transformers'
Gemma4ForCausalLM on two tiny random configs that between them switch every feature on
(PLE, KV sharing, double-wide MLP, proportional RoPE, two head sizes, V norm, K=V, MoE,
layer scalars, final softcap). 70 tokens cross the window (8) and the full layers' key block.
"""
from pathlib import Path

import pytest
import torch
from tiny_gemma import TINY_GEMMA4_MOE, TINY_GEMMA4_PLE, make_hf_gemma4, token_ids, write_gemma4_gguf
from verispec.testing import forward_one
from verispec_gemma4.loader import load

NUM_PREFILL, NUM_DECODE = 60, 10
PRESETS = {"ple_kv_shared": TINY_GEMMA4_PLE, "moe_k_eq_v": TINY_GEMMA4_MOE}


@pytest.fixture(scope="module", params=list(PRESETS))
def tiny(request, tmp_path_factory):
    hf = make_hf_gemma4(PRESETS[request.param])
    path = write_gemma4_gguf(tmp_path_factory.mktemp("gemma4") / f"{request.param}.gguf", hf)
    ids = token_ids(NUM_PREFILL + NUM_DECODE)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]  # [70, V]
        hf_hidden = hf.model(ids[None]).last_hidden_state[0]
    return path, ids, hf_logits, hf_hidden


def _load(path, dtype, **options):
    rows = {"max_rows_per_forward": 16, "max_verify_rows": 16}  # rings of 23 slots: wrapped by 70 tokens
    return load(path, dtype=dtype, use_cache=False, tokenizer=False, **{**rows, **options})


def test_fp32_logits_match_transformers(tiny):
    path, ids, hf_logits, hf_hidden = tiny
    model = _load(path, "float32")
    seq = model.new_sequence()
    out = forward_one(model, seq, ids[:NUM_PREFILL], logits="all", hidden=True)
    decodes = torch.stack([forward_one(model, seq, ids[i:i + 1], logits="last").logits[0]
                           for i in range(NUM_PREFILL, len(ids))])
    torch.testing.assert_close(torch.cat([out.logits, decodes]), hf_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.hidden, hf_hidden[:NUM_PREFILL], atol=1e-4, rtol=0)  # pre-softcap tap


@pytest.mark.parametrize("dtype", ["int8"])  # the batch-invariant dtypes (bf16 is not on every CPU: weights.quant)
def test_verify_rows_are_bitwise_one_row_decodes(tiny, dtype):
    path, ids, _, _ = tiny
    model = _load(path, dtype)
    assert model.spec_batch_invariant
    prefix = 58
    seq = model.new_sequence()
    forward_one(model, seq, ids[:prefix], logits="last")
    singles = torch.cat([forward_one(model, seq, ids[i:i + 1], logits="all").logits
                         for i in range(prefix, prefix + 9)])
    model.truncate(seq, prefix)
    for k in (2, 5, 9):
        rows = forward_one(model, seq, ids[prefix:prefix + k], logits="all", verify=True).logits
        assert torch.equal(rows, singles[:k]), f"k={k}"
        model.keep(seq, 0)


def test_rollback_past_the_window_equals_a_plain_run(tiny):
    path, ids, _, _ = tiny
    model = _load(path, "int8", max_rows_per_forward=9, max_verify_rows=9)
    seq = model.new_sequence()
    forward_one(model, seq, ids[:30], logits="none")
    wrong = (ids[31:39] + 1) % model.vocab_size
    forward_one(model, seq, torch.cat([ids[30:31], wrong]), logits="all", verify=True)
    model.keep(seq, 1)  # rows 31..38 rejected: the rings (8 + 9 - 1 slots) were overwritten past the window
    assert model.seq_len(seq) == 31
    got = forward_one(model, seq, ids[31:32], logits="last").logits
    plain_seq = model.new_sequence()
    for i in range(32):
        plain = forward_one(model, plain_seq, ids[i:i + 1], logits="last").logits
    assert torch.equal(got, plain)


def test_kv_shared_layers_own_no_cache():
    from verispec_gemma4.modeling_gemma4 import Gemma4Config

    hf_config = make_hf_gemma4(TINY_GEMMA4_PLE).config
    assert [hf_config.kv_sharing_modes[i] for i in (5, 6, 7)] == ["reuse"] * 3
    config = Gemma4Config(vocab_size=131, hidden_size=48, num_hidden_layers=8, num_attention_heads=3,
                          layer_types=hf_config.layer_types, num_key_value_heads=(1,) * 8, intermediate_size=(37,) * 8,
                          num_kv_shared_layers=3)
    assert [config.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 4, 4, 4, 3]


def test_hidden_taps_match_transformers_hidden_states(tiny):
    """`Segment.tap_layers` (what a DFlash drafter reads): the residual entering each layer, as
    transformers' hidden_states[i] (PLE and layer scalars inside the layer), fp32."""
    from verispec.seams import Segment

    path, ids, _, _ = tiny
    model = _load(path, "float32")
    layers = (1, model.num_layers - 1)
    out = model.forward([Segment(model.new_sequence(), ids[:NUM_PREFILL], logits="none", hidden=True,
                                 tap_layers=layers)])[0]
    hf = make_hf_gemma4(PRESETS[Path(path).stem])  # the fixture's weights (make_hf_gemma4 is seeded)
    with torch.no_grad():
        states = hf.model(ids[None, :NUM_PREFILL], output_hidden_states=True).hidden_states
    assert out.hidden.shape == (NUM_PREFILL, 2 * model.hidden_size)
    torch.testing.assert_close(out.hidden, torch.cat([states[i][0] for i in layers], dim=-1), atol=1e-4, rtol=0)
