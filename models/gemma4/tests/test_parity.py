"""Our Gemma 3 trunk, loaded from a GGUF by the real loader, against transformers' Gemma3ForCausalLM.

The sequence (70 tokens) crosses the sliding window (8), the rings (8 + 16 - 1 slots) and the
64-slot key block of the full layer; prefill runs in 16-row chunks, then one-row decodes.
"""
import pytest
import torch
from tiny_gemma import TINY_GEMMA3, make_hf_gemma3, token_ids, write_gemma3_gguf
from verispec.gguf.io import BadTensorShape, MissingTensor
from verispec.seams import Segment
from verispec.testing import forward_one

NUM_PREFILL, NUM_DECODE = 60, 10


@pytest.fixture(scope="module")
def hf_logits(hf_gemma3):
    with torch.no_grad():
        return hf_gemma3(token_ids(NUM_PREFILL + NUM_DECODE)[None]).logits[0]  # [70, V]


def _our_logits(model):
    ids = token_ids(NUM_PREFILL + NUM_DECODE)
    seq = model.new_sequence()
    prefill = forward_one(model, seq, ids[:NUM_PREFILL], logits="all").logits
    decodes = [forward_one(model, seq, ids[i:i + 1], logits="last").logits[0]
               for i in range(NUM_PREFILL, NUM_PREFILL + NUM_DECODE)]
    return torch.cat([prefill, torch.stack(decodes)])


def test_fp32_logits_match_transformers(load_tiny, hf_logits):
    ours = _our_logits(load_tiny("float32"))
    torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0.15), ("int8", 0.3)])
def test_reduced_precision_stays_near_fp32(load_tiny, hf_logits, dtype, atol):
    # bf16-rounded matmul inputs/outputs and int8 weights: a loose sanity bound (logits span ±5), not parity
    ours = _our_logits(load_tiny(dtype))
    torch.testing.assert_close(ours, hf_logits, atol=atol, rtol=0)


def test_final_hidden_tap_is_the_normed_residual(load_tiny, hf_gemma3):
    ids = token_ids(20)
    model = load_tiny("float32")
    out = forward_one(model, model.new_sequence(), ids, logits="all", hidden=True)
    with torch.no_grad():
        hf_hidden = hf_gemma3.model(ids[None]).last_hidden_state[0]  # after the final norm
    assert out.hidden.shape == (20, model.view().tap_feature_size(None)) == (20, TINY_GEMMA3["hidden_size"])
    torch.testing.assert_close(out.hidden, hf_hidden, atol=1e-5, rtol=0)


def test_hidden_taps_are_the_residuals_entering_layers(load_tiny, hf_gemma3):
    ids = token_ids(12)
    model = load_tiny("float32")
    assert model.view().tap_feature_size((1, 5)) == 2 * TINY_GEMMA3["hidden_size"]
    out = model.forward([Segment(model.new_sequence(), ids, logits="last", hidden=True, tap_layers=(1, 5))])[0]
    taps = out.hidden
    assert taps.shape == (12, 2 * TINY_GEMMA3["hidden_size"]) and out.logits.shape == (1, model.vocab_size)
    with torch.no_grad():
        states = hf_gemma3.model(ids[None], output_hidden_states=True).hidden_states  # states[i] enters layer i
    torch.testing.assert_close(taps, torch.cat([states[1][0], states[5][0]], dim=-1), atol=1e-5, rtol=0)


def test_softcap_and_linear_rope_scaling_follow_the_config(tmp_path):
    # not in any gemma3 file we ship, but in the family's key set (llama.cpp reads both)
    from verispec_gemma4.loader import load

    hf = make_hf_gemma3(seed=3, final_logit_softcapping=5.0,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    path = write_gemma3_gguf(tmp_path / "capped.gguf", hf, extra_metadata={
        "gemma3.final_logit_softcapping": 5.0, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 4.0})
    ids = token_ids(24, seed=4)
    model = load(path, dtype="float32", use_cache=False, tokenizer=False)
    ours = forward_one(model, model.new_sequence(), ids, logits="all").logits
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    assert theirs.abs().max() <= 5.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_missing_tensor_names_the_tensor(tmp_path, hf_gemma3):
    from verispec_gemma4.loader import load

    path = write_gemma3_gguf(tmp_path / "broken.gguf", hf_gemma3, drop={"blk.3.ffn_up.weight"})
    with pytest.raises(MissingTensor, match="blk.3.ffn_up.weight"):
        load(path, use_cache=False, tokenizer=False)


def test_wrong_shape_names_the_tensor(tmp_path, hf_gemma3):
    from tiny_gemma import gemma3_gguf_metadata, gemma3_gguf_tensors
    from verispec.testing.fixture_writer import write_gguf
    from verispec_gemma4.loader import load

    tensors = gemma3_gguf_tensors(hf_gemma3)
    tensors["blk.2.attn_k.weight"] = tensors["blk.2.attn_k.weight"][:8]  # 8 of 16 output rows
    path = write_gguf(tmp_path / "bad.gguf", arch="gemma3", metadata=gemma3_gguf_metadata(hf_gemma3.config),
                      tensors=tensors)
    with pytest.raises(BadTensorShape, match="blk.2.attn_k.weight"):
        load(path, use_cache=False, tokenizer=False)
