"""The GPU path of the Gemma 3 trunk, proven on the CPU: `to_device("cpu")` with VERISPEC_TRITON=1
under Triton's interpreter (TRITON_INTERPRET=1) runs the code a CUDA trunk runs but for the
`.to(device)`: kernels.triton_qmatmul for every block linear, kernels.triton_attend over
nn.kv_pool's pools for sliding and full layers alike (a sliding layer's window a mask there, not a
ring), triton_norm for the four norms and the q/k norms, triton_glu for the GeGLU, both RoPE tables.

A tiny Gemma 3 (window 8; layers sliding, full, sliding) with quantised linears: logits bitwise the
CPU trunk's C path while its sliding rings have not wrapped (slot = position in both, masked slots
add exact zeros), within fp32 rounding past that (the ring's slot order is not the position order);
n-gram speculative greedy equal to plain greedy; verify rows bitwise one-row decodes; two sequences
in one forward; keep after a rejected draft."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # read as triton is imported
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

from tiny_gemma import gemma3_gguf_tensors, make_hf_gemma3, token_ids, write_gemma3_gguf  # noqa: E402
from verispec.kernels import ckernels, triton_dispatch  # noqa: E402
from verispec.nn.kv_pool import PooledKVCache  # noqa: E402
from verispec.testing.device_path import PlacedTrunkSuite, count_device_kernels, greedy  # noqa: E402
from verispec_gemma4.loader import load  # noqa: E402

pytestmark = [
    pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: no C path to compare with"),
    pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="the CPU proof of the GPU path needs the interpreter"),
]

#: linear widths multiples of 32 (a block); head dim a power of two (triton_attend's blocks)
SIZES = {"hidden_size": 64, "intermediate_size": 64, "head_dim": 16, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2}  # a sliding layer, then a full one
TYPES = {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"}
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9]  # past the window (8)


@pytest.fixture(scope="module")
def trunks(tmp_path_factory):
    """(the CPU trunk, the same file's trunk on the device path) with VERISPEC_TRITON=1."""
    hf = make_hf_gemma3(**SIZES)
    types = {n: TYPES[n.split(".")[-2]] for n in gemma3_gguf_tensors(hf) if n.split(".")[-2] in TYPES}
    path = write_gemma3_gguf(tmp_path_factory.mktemp("device") / "q.gguf", hf, tensor_types=types,
                             extra_metadata={"gemma3.attention.sliding_window_pattern": 2})  # layer 1 full
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_TRITON", "1")
        assert triton_dispatch._interpreting(), "triton was imported before TRITON_INTERPRET=1 was set"
        cpu = load(path, dtype="gguf", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)
        dev = load(path, dtype="gguf", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)
        dev.to_device("cpu")
        yield cpu, dev


@pytest.fixture
def calls(monkeypatch):
    return count_device_kernels(monkeypatch)


def test_the_file_has_sliding_and_full_layers_on_pooled_caches(trunks):
    _, dev = trunks
    assert [layer.is_sliding for layer in dev.model.layers] == [True, False]
    seq = dev.new_sequence()
    assert all(isinstance(c, PooledKVCache) for c in dev._state(seq).layers)
    dev.release(seq)
    assert dev.model.rotary_local.table is not None and dev.model.rotary_global.table is not None


def test_plain_greedy_logits_bitwise_the_cpu_path_before_the_ring_wraps(trunks, calls):
    cpu, dev = trunks  # rings of 8 + 16 - 1 = 23 slots: a 19-token prompt and 4 decodes fill 22
    with pytest.MonkeyPatch.context() as mp:  # the CPU trunk with its C kernels
        mp.setattr(ckernels, "library", ckernels.LIBRARY.load)
        want_tokens, want = greedy(cpu, PROMPT, 4)
    got_tokens, got = greedy(dev, PROMPT, 4)
    assert all(calls[name] for name in ("qmatmul", "attend", "rms_norm", "glu")), calls  # Gemma 3's, no C kernel
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3g}"
    assert got_tokens == want_tokens


def test_past_the_ring_the_logits_stay_the_cpu_paths_within_rounding(trunks):
    cpu, dev = trunks
    prompt = token_ids(30, seed=3).tolist()  # 30 tokens: two chunks of 16 rows, the rings wrapped
    want_tokens, want = greedy(cpu, prompt, 3)
    got_tokens, got = greedy(dev, prompt, 3)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class TestPlacedGemma3(PlacedTrunkSuite):
    prompt = PROMPT
    verify_tokens = PROMPT + [8, 6, 10, 12, 30]
    verify_prefix, verify_rows = 12, 5  # the kernels' own tests cover 1..17 rows bitwise
    stream_steps = 8

    def speculator(self, trunk, plain):
        from verispec_ngram.speculator import NGramSpeculator

        return NGramSpeculator(max_draft_tokens=4)
