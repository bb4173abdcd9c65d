"""The GPU path of the Qwen 3.5 hybrid trunk, proven on the CPU: `to_device("cpu")` with
VERISPEC_TRITON=1 under Triton's interpreter (TRITON_INTERPRET=1) runs the code a CUDA trunk runs
but for the `.to(device)`: kernels.triton_qmatmul for every block linear, kernels.triton_attend
over nn.kv_pool's pools for the full-attention layer, kernels.triton_delta_rule for the GDN rows
with their recurrent states on the device, the conv and the q/k l2norm as fixed-order elementwise
statements, triton_norm for the norms.

A tiny Qwen 3.5 (layers GDN, attention; every linear block-quantised): logits within
fp32 rounding of the CPU trunk's (the delta rule's Triton order and the l2norm's lane sums are not
the CPU loop's); speculative greedy (oracle drafts, random accept counts) equal to plain greedy;
verify rows bitwise one-row decodes; two sequences in one forward each as alone; keep after a
rejected draft selecting every layer's state; the MTP head switched off with one warning."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # read as triton is imported
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

import tiny_qwen35  # noqa: E402
from tiny_qwen35 import build_hf_model, hf_to_gguf  # noqa: E402
from verispec.kernels import ckernels, triton_dispatch  # noqa: E402
from verispec.nn.kv_pool import PooledKVCache  # noqa: E402
from verispec.nn.state import RecurrentState  # noqa: E402
from verispec.testing.device_path import PlacedTrunkSuite, count_device_kernels, greedy  # noqa: E402
from verispec.testing.fixture_writer import write_gguf  # noqa: E402
from verispec_qwen35.loader import load  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1",
                                reason="the CPU proof of the GPU path needs the interpreter")

#: every linear's input width a multiple of 32 (a block): D 64, value_dim 6 x 16, H x Dh 3 x 32; one
#: recurrent (gated delta rule) layer and one attention layer, the least that runs both kernels (the
#: interpreter's time is per layer)
SIZES = {"hidden_size": 64, "intermediate_size": 64, "linear_value_head_dim": 16, "num_hidden_layers": 2,
         "layer_types": ["linear_attention", "full_attention"]}
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def trunks(tmp_path_factory):
    """(the CPU trunk, the same file's trunk on the device path) with VERISPEC_TRITON=1."""
    model_type, arch, kwargs, options = tiny_qwen35.TINY_CONFIGS["dense_mtp"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny_qwen35.TINY_CONFIGS, "device", (model_type, arch, {**kwargs, **SIZES}, options))
        hf, mtp = build_hf_model("device")
        arch, metadata, tensors = hf_to_gguf(hf, mtp, options)
        types = {name: "Q8_0" if i % 2 else "Q4_0" for i, (name, t) in enumerate(sorted(tensors.items()))
                 if t.dim() == 2 and t.shape[1] % 32 == 0}
        path = write_gguf(tmp_path_factory.mktemp("device") / "q.gguf", arch=arch, metadata=metadata,
                          tensors=tensors, tensor_types=types)
        mp.setenv("VERISPEC_TRITON", "1")
        assert triton_dispatch._interpreting(), "triton was imported before TRITON_INTERPRET=1 was set"
        cpu = load(path, dtype="gguf", use_cache=False, tokenizer=False)
        dev = load(path, dtype="gguf", use_cache=False, tokenizer=False)
        assert dev.draft_head is not None  # the file's MTP block
        dev.to_device("cpu")
        yield cpu, dev


def test_the_states_are_placed_and_the_mtp_head_is_off(trunks):
    _, dev = trunks
    assert dev.draft_head is None
    seq = dev.new_sequence()
    kinds = [type(state) for state in dev._state(seq).layers]
    assert kinds == [RecurrentState, PooledKVCache]
    dev.release(seq)


@pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: no C path to compare with")
def test_plain_greedy_is_the_cpu_paths_within_rounding(trunks, monkeypatch):
    cpu, dev = trunks
    want_tokens, want = greedy(cpu, PROMPT, 4)
    calls = count_device_kernels(monkeypatch)
    got_tokens, got = greedy(dev, PROMPT, 4)
    assert all(calls[name] for name in ("qmatmul", "attend", "rms_norm", "delta_rule")), calls
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class TestPlacedQwen35(PlacedTrunkSuite):
    prompt = verify_tokens = PROMPT
    verify_prefix, verify_rows = 12, 5  # the kernels' own tests cover 1..17 rows bitwise
    stream_steps = 8
    truncate = False  # recurrent state

    def speculator(self, trunk, plain):
        """Drafts from the plain stream with random accept counts (the random tiny model repeats
        too little for n-gram drafts to be accepted): full, partial and no acceptance, each kept."""
        import random

        from verispec.testing import oracle_speculator

        return oracle_speculator(plain, vocab_size=trunk.vocab_size, max_draft_tokens=4, rng=random.Random(0))
