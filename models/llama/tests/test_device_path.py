"""The GPU path of the llama/qwen2 trunk, proven on the CPU: `to_device("cpu")` with
VERISPEC_TRITON=1 under Triton's interpreter (TRITON_INTERPRET=1) runs exactly the code a CUDA
trunk runs (kernels.triton_qmatmul for every block linear, the LM head and the embedding's
PyTorch row gather included, kernels.triton_attend over nn.kv_pool's pools, the C kernels'
PyTorch statements for RMSNorm / SwiGLU, the RoPE table), but for the `.to(device)`.

Checked against the same file's CPU trunk (the C kernels): logits bitwise (the Triton kernels and
the statements are bitwise the references the C kernels are held to), speculative greedy streams
(full, partial and no acceptance) equal to plain greedy, a k-row verify (k = 2..5) bitwise the
one-row decodes, and keep / rollback after a rejected draft leaving the caches as a plain run's.
Tiny shapes and short streams: the interpreter runs each Triton program in numpy, ~0.2 s a
(row, head) of attention (the kernels' own tests cover 1..17 rows bitwise)."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # read as triton is imported
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

from tiny_llama import build_hf_model, hf_to_gguf  # noqa: E402
from verispec.kernels import ckernels, triton_attend, triton_dispatch, triton_qmatmul  # noqa: E402
from verispec.nn.kv_pool import PooledKVCache  # noqa: E402
from verispec.testing.device_path import PlacedTrunkSuite, count_device_kernels, forbid_c_kernels, greedy  # noqa: E402
from verispec.testing.fixture_writer import write_gguf  # noqa: E402
from verispec_llama.loader import load  # noqa: E402

pytestmark = [
    pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: no C path to compare with"),
    pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="the CPU proof of the GPU path needs the interpreter"),
]

#: ggml type per GGUF tensor (the embedding and the untied head block-typed too)
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q5_1"}
CONFIGS = {  # linear widths multiples of 32; head dims powers of two (triton_attend's blocks); one layer:
    # the interpreter's time is attention's (row, head) programs, and a second layer checks nothing new
    "llama_dev": ("llama", {"vocab_size": 131, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2_dev": ("qwen2", {"vocab_size": 113, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}),
}
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trunks(request, tmp_path_factory, monkeypatch_module):
    """(the CPU trunk, the same file's trunk on the device path) with VERISPEC_TRITON=1."""
    import tiny_llama

    monkeypatch_module.setitem(tiny_llama.TINY_CONFIGS, request.param, CONFIGS[request.param])
    arch, metadata, tensors = hf_to_gguf(build_hf_model(request.param))
    types = {name: TYPES[name.split(".")[-2]] for name in tensors
             if name.endswith(".weight") and name.split(".")[-2] in TYPES}
    path = write_gguf(tmp_path_factory.mktemp("device") / "q.gguf", arch=arch, metadata=metadata, tensors=tensors,
                      tensor_types=types)
    monkeypatch_module.setenv("VERISPEC_TRITON", "1")
    assert triton_dispatch._interpreting(), "triton was imported before TRITON_INTERPRET=1 was set"
    cpu = load(path, dtype="gguf", context_length=256, use_cache=False)
    dev = load(path, dtype="gguf", context_length=256, use_cache=False)
    dev.to_device("cpu")
    return cpu, dev


@pytest.fixture
def calls(monkeypatch):
    return count_device_kernels(monkeypatch)


def test_plain_greedy_logits_bitwise_the_cpu_path(trunks, calls):
    cpu, dev = trunks
    with pytest.MonkeyPatch.context() as mp:  # the CPU trunk with its C kernels
        mp.setattr(ckernels, "library", ckernels.LIBRARY.load)
        want_tokens, want = greedy(cpu, PROMPT, 4)
    got_tokens, got = greedy(dev, PROMPT, 4)
    assert calls["qmatmul"] > 0 and calls["attend"] > 0, calls
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3g}"
    assert got_tokens == want_tokens


def test_the_device_trunk_holds_pooled_caches_and_its_table(trunks):
    _, dev = trunks
    seq = dev.new_sequence()
    assert all(isinstance(c, PooledKVCache) for c in dev._state(seq).layers)
    assert dev.model.rotary_emb.table is not None
    dev.release(seq)


class TestPlacedLlama(PlacedTrunkSuite):
    prompt = PROMPT
    verify_tokens = PROMPT + [8, 6, 10, 12, 30]
    verify_rows = 5
    stream_steps = 8

    def speculator(self, trunk, plain):
        """Drafts from the plain stream with random accept counts (eight tokens are too few for the
        tiny random model to repeat itself for an n-gram drafter): full, partial and no acceptance."""
        import random

        from verispec.testing import oracle_speculator

        return oracle_speculator(plain, vocab_size=trunk.vocab_size, max_draft_tokens=4, rng=random.Random(0))


def test_the_llama_family_declares_cuda():
    from verispec.device import require_trunk_device
    from verispec_llama.modeling_llama import LlamaForCausalLM

    require_trunk_device(torch.device("cuda"), LlamaForCausalLM)


def test_with_triton_off_the_device_path_runs_pytorch_and_keeps_the_stream(trunks, monkeypatch):
    """VERISPEC_TRITON=0 on a placed trunk: reference_matmul and the PyTorch attention over the
    pools (never a C kernel, never Triton); attention's softmax / bmm are not the kernel's order,
    so logits within 1e-4 of the C path's, the same greedy tokens."""
    cpu, dev = trunks
    want_tokens, want = greedy(cpu, PROMPT, 4)
    monkeypatch.setenv("VERISPEC_TRITON", "0")
    forbid_c_kernels(monkeypatch)
    monkeypatch.setattr(triton_attend, "attend", None)  # not called
    monkeypatch.setattr(triton_qmatmul, "qmatmul", None)
    got_tokens, got = greedy(dev, PROMPT, 4)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
