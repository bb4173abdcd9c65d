"""The GPU path of the llama/qwen2 trunk, proven on the CPU: `to_device("cpu")` with
VERISPEC_TRITON=1 under Triton's interpreter (TRITON_INTERPRET=1) runs exactly the code a CUDA
trunk runs (kernels.triton_qmatmul for every block linear, the LM head and the embedding's
PyTorch row gather included, kernels.triton_attend over nn.kv_pool's pools, the C kernels'
PyTorch statements for RMSNorm / SwiGLU, the RoPE table), but for the `.to(device)`.

Checked against the same file's CPU trunk (the C kernels): logits bitwise (the Triton kernels and
the statements are bitwise the references the C kernels are held to), n-gram speculative greedy
streams equal to plain greedy, a k-row verify (k = 1..9) bitwise the one-row decodes, and keep /
rollback after a rejected draft leaving the caches as a plain run's. Tiny shapes: the
interpreter runs each Triton program in numpy."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # read as triton is imported
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

from tiny_llama import build_hf_model, hf_to_gguf  # noqa: E402
from verispec.kernels import ckernels, triton_attend, triton_dispatch, triton_qmatmul  # noqa: E402
from verispec.nn.kv_pool import PooledKVCache  # noqa: E402
from verispec.testing import forward_one, run_greedy_requests  # noqa: E402
from verispec.testing.fixture_writer import write_gguf  # noqa: E402
from verispec_llama.loader import load  # noqa: E402

pytestmark = [
    pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: no C path to compare with"),
    pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="the CPU proof of the GPU path needs the interpreter"),
]

#: ggml type per GGUF tensor (the embedding and the untied head block-typed too)
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q5_1"}
CONFIGS = {  # linear widths multiples of 32; head dims powers of two (triton_attend's blocks)
    "llama_dev": ("llama", {"vocab_size": 131, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2_dev": ("qwen2", {"vocab_size": 113, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
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
    """Counts of the Triton kernels' calls; any C kernel called fails the test."""
    counts = {"qmatmul": 0, "attend": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(triton_qmatmul, "qmatmul", counting("qmatmul", triton_qmatmul.qmatmul))
    monkeypatch.setattr(triton_attend, "attend", counting("attend", triton_attend.attend))
    original = ckernels.library()

    class Guard:
        def __getattr__(self, name):
            raise AssertionError(f"the device path called the C kernel {name}")

    monkeypatch.setattr(ckernels, "library", lambda: Guard())
    yield counts
    monkeypatch.setattr(ckernels, "library", lambda: original)


def _greedy(trunk, prompt, steps):
    """Plain greedy decode: (tokens, every step's logits fp32 [steps, V])."""
    seq = trunk.new_sequence()
    logits = [forward_one(trunk, seq, prompt, logits="last").logits[-1]]
    tokens = []
    for _ in range(steps - 1):
        tokens.append(int(logits[-1].argmax()))
        logits.append(forward_one(trunk, seq, tokens[-1:], logits="last").logits[-1])
    tokens.append(int(logits[-1].argmax()))
    trunk.release(seq)
    return tokens, torch.stack(logits)


def test_plain_greedy_logits_bitwise_the_cpu_path(trunks, calls):
    cpu, dev = trunks
    with pytest.MonkeyPatch.context() as mp:  # the CPU trunk with its C kernels
        mp.setattr(ckernels, "library", ckernels.LIBRARY.load)
        want_tokens, want = _greedy(cpu, PROMPT, 6)
    got_tokens, got = _greedy(dev, PROMPT, 6)
    assert calls["qmatmul"] > 0 and calls["attend"] > 0, calls
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3g}"
    assert got_tokens == want_tokens


def test_the_device_trunk_holds_pooled_caches_and_its_table(trunks):
    _, dev = trunks
    seq = dev.new_sequence()
    assert all(isinstance(c, PooledKVCache) for c in dev._state(seq).layers)
    assert dev.model.rotary_emb.table is not None
    dev.release(seq)


def test_ngram_speculative_greedy_is_the_plain_stream(trunks):
    from verispec_ngram.speculator import NGramSpeculator

    _, dev = trunks
    plain = [tokens for tokens, _ in run_greedy_requests(dev, [PROMPT], 12)]
    spec = run_greedy_requests(dev, [PROMPT], 12, NGramSpeculator(max_draft_tokens=4), max_draft_tokens=4,
                               max_running=1)
    assert [tokens for tokens, _ in spec] == plain
    assert sum(e.stats.num_accepted_tokens for _, e in spec) > 0, "no draft was accepted: speculation untested"


def test_verify_rows_are_one_row_decodes_k_1_to_9(trunks):
    _, dev = trunks
    tokens = PROMPT + [8, 6, 10, 12, 30, 31, 32, 2, 4]
    prefix = 8
    base = dev.new_sequence()
    forward_one(dev, base, tokens[:prefix], logits="last")
    seq = dev.fork(base, prefix)
    alone = torch.cat([forward_one(dev, seq, tokens[i:i + 1]).logits for i in range(prefix, prefix + 9)])
    dev.release(seq)
    for k in range(1, 10):
        seq = dev.fork(base, prefix)
        rows = forward_one(dev, seq, tokens[prefix:prefix + k], verify=True).logits
        assert torch.equal(rows, alone[:k]), f"k={k}: max |diff| {(rows - alone[:k]).abs().max():.3g}"
        dev.release(seq)
    dev.release(base)


def test_two_sequences_in_one_forward_are_each_alone(trunks):
    from verispec.seams import Segment

    _, dev = trunks
    seqs = [dev.new_sequence() for _ in range(2)]
    for s, start in zip(seqs, (0, 3)):
        forward_one(dev, s, PROMPT[start:start + 5], logits="last")
    both = dev.forward([Segment(seqs[0], [PROMPT[5]], verify=True, logits="all"), Segment(seqs[1], PROMPT[8:10])])
    for s in seqs:
        dev.release(s)
    alone = []
    for start, nxt in ((0, [PROMPT[5]]), (3, PROMPT[8:10])):
        s = dev.new_sequence()
        forward_one(dev, s, PROMPT[start:start + 5], logits="last")
        alone.append(forward_one(dev, s, nxt, logits="last").logits[-1])
        dev.release(s)
    assert torch.equal(both[0].logits[-1], alone[0]) and torch.equal(both[1].logits[-1], alone[1])


def test_keep_after_a_rejected_draft_leaves_a_plain_runs_caches(trunks):
    _, dev = trunks
    plain = dev.new_sequence()
    forward_one(dev, plain, PROMPT[:10] + [40, 41], logits="last")
    spec = dev.new_sequence()
    forward_one(dev, spec, PROMPT[:10], logits="last")
    forward_one(dev, spec, [40, 41, 42, 43], verify=True)  # 42, 43 rejected
    dev.keep(spec, 2)
    assert dev.seq_len(spec) == dev.seq_len(plain) == 12
    for a, b in zip(dev._state(spec).layers, dev._state(plain).layers):
        ka, va, _ = a.read(12)
        kb, vb, _ = b.read(12)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    nxt = [forward_one(dev, s, [44, 45], logits="all").logits for s in (spec, plain)]
    assert torch.equal(nxt[0], nxt[1])
    # a rollback past the kept rows (prefix reuse): truncate, then the same continuation
    dev.truncate(spec, 10)
    again = forward_one(dev, spec, [40, 41, 44, 45], logits="all").logits[2:]
    assert torch.equal(again, nxt[1])
    for s in (spec, plain):
        dev.release(s)


def test_the_llama_family_declares_cuda():
    from verispec.device import require_trunk_device
    from verispec_llama.modeling_llama import LlamaForCausalLM

    require_trunk_device(torch.device("cuda"), LlamaForCausalLM)


def test_with_triton_off_the_device_path_runs_pytorch_and_keeps_the_stream(trunks, monkeypatch):
    """VERISPEC_TRITON=0 on a placed trunk: reference_matmul and the PyTorch attention over the
    pools (never a C kernel, never Triton); attention's softmax / bmm are not the kernel's order,
    so logits within 1e-4 of the C path's, the same greedy tokens."""
    cpu, dev = trunks
    want_tokens, want = _greedy(cpu, PROMPT, 6)
    monkeypatch.setenv("VERISPEC_TRITON", "0")

    class Guard:
        def __getattr__(self, name):
            raise AssertionError(f"the device path called the C kernel {name}")

    monkeypatch.setattr(ckernels, "library", lambda: Guard())
    monkeypatch.setattr(triton_attend, "attend", None)  # not called
    monkeypatch.setattr(triton_qmatmul, "qmatmul", None)
    got_tokens, got = _greedy(dev, PROMPT, 6)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
