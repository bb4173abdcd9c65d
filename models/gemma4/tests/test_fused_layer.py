"""Gemma 3's fused decoder layer (verispec.nn.layers, layers.c) gives the op-by-op forward's bits:
a tiny Gemma 3 with quantised linears of several GGUF types, in the `gguf` weight mode, sliding
and full layers, through a prefill longer than the window (chunked), decodes and a verify, with
the fused path checked to have run; and the real 270M when it is installed."""
import pytest
import torch
from tiny_gemma import make_hf_gemma3, token_ids, write_gemma3_gguf
from verispec.nn import ckernels
from verispec.nn.layers import DecoderLayerKernel
from verispec.testing import forward_one
from verispec_gemma4.loader import load

pytestmark = pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: the kernels are not built")

#: linear widths multiples of 32 (a block); sliding window 8, layers 0-4 sliding, 5 full, 6 sliding
SIZES = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1}
TYPES = {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf = make_hf_gemma3(**SIZES)
    from tiny_gemma import gemma3_gguf_tensors

    names = gemma3_gguf_tensors(hf)
    types = {n: TYPES[n.split(".")[2]] for n in names if n.startswith("blk.") and n.split(".")[2] in TYPES}
    path = write_gemma3_gguf(tmp_path_factory.mktemp("fused") / "q.gguf", hf, tensor_types=types)
    return load(path, dtype="gguf", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)


def _run(target, fused: bool):
    for layer in target.model.layers:
        layer.fused = fused
    ids = token_ids(60).tolist()
    seq = target.new_sequence()
    prefill = forward_one(target, seq, ids[:40], logits="all").logits  # 16-row chunks past the window
    decodes = torch.cat([forward_one(target, seq, ids[40 + i:41 + i]).logits for i in range(3)])
    verify = forward_one(target, seq, ids[43:50], verify=True).logits
    target.release(seq)
    return prefill, decodes, verify


def test_the_fused_layer_is_the_op_by_op_layer_bitwise(target, monkeypatch):
    calls = []
    original = DecoderLayerKernel.__call__
    monkeypatch.setattr(DecoderLayerKernel, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    fused = _run(target, True)
    assert len(calls) >= 7, "the fused path did not run"
    count = len(calls)
    plain = _run(target, False)
    assert len(calls) == count  # switched off: not called
    for name, a, b in zip(("prefill", "decode", "verify"), fused, plain):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max():.3g}"


@pytest.mark.real_checkpoint
def test_the_real_270m_fused_is_op_by_op_bitwise():
    from verispec.api import load_target, resolve_model_path
    from verispec.checkpoints import CheckpointNotInstalled
    from verispec.registry import Registry

    registry = Registry.discover()
    try:
        path = resolve_model_path("gemma3-270m", registry)
    except CheckpointNotInstalled as e:
        pytest.skip(f"gemma3-270m is not installed: {e}")
    trunk = load_target(path, registry, dtype="gguf")
    assert all(layer._fused_kernel(trunk.model.rotary_local) is not None for layer in trunk.model.layers)
    fused = _run(trunk, True)
    plain = _run(trunk, False)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
