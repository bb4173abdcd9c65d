"""The GPU path of the Qwen 3.5 hybrid trunk, proven on the CPU: `to_device("cpu")` with
VERISPEC_TRITON=1 under Triton's interpreter (TRITON_INTERPRET=1) runs the code a CUDA trunk runs
but for the `.to(device)`: kernels.triton_qmatmul for every block linear, kernels.triton_attend
over nn.kv_pool's pools for the full-attention layer, kernels.triton_delta_rule for the GDN rows
with their recurrent states on the device, kernels.triton_lane_dot for the q/k l2norm's sums (and
the MoE router's and shared-expert gate's), the conv as in-order multiply-adds, triton_norm for
the norms (the SwiGLUs' silu · up stays elementwise torch, as on the CPU: triton_glu is not called).

Tiny Qwen 3.5s of two layers (GDN, attention; every linear block-quantised, Q4_0 and Q8_0), dense
with an MTP block and MoE: logits within fp32 rounding of the CPU trunk's, not bitwise (the delta
rule's Triton order and the lane-order l2norm are not the CPU loop's einsum and torch sums: see
kernels/triton_delta_rule.py); every Triton kernel called and no C kernel; speculative greedy
(oracle drafts, random accept counts) equal to plain greedy; verify rows k = 2..9 bitwise one-row
decodes; two sequences in one forward each as alone; keep after a rejected draft selecting every
layer's state; the MTP head drafting on the CPU from the placed trunk."""
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
from verispec.testing import forward_one, run_greedy  # noqa: E402
from verispec.testing.device_path import PlacedTrunkSuite, count_device_kernels, greedy  # noqa: E402
from verispec.testing.fixture_writer import write_gguf  # noqa: E402
from verispec.testing.gguf_weights import assert_verify_rows_are_one_row_decodes  # noqa: E402
from verispec_qwen35.loader import load  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1",
                                reason="the CPU proof of the GPU path needs the interpreter")

#: two layers (GDN, attention) and few heads: the interpreter is slow. Every linear's input width
#: a multiple of 32 (a block): D 64, value_dim 4 x 16 (2 key heads, tiled), H x Dh 2 x 16 (one KV
#: head), FFN and expert widths 64 / 32
SIZES = {"num_hidden_layers": 2, "full_attention_interval": 2, "hidden_size": 64, "intermediate_size": 64,
         "num_attention_heads": 2, "head_dim": 16, "linear_num_value_heads": 4, "linear_value_head_dim": 16,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9, 2, 7, 3, 11, 4, 1, 5, 9]
#: the placed trunk's logits against the CPU trunk's (measured 1.5e-6 at unit-scale weights)
ATOL = 1e-5


def _placed(tmp_path_factory, name):
    """(the CPU trunk, the same file's trunk placed on the device path) of TINY_CONFIGS[name] at SIZES."""
    model_type, arch, kwargs, options = tiny_qwen35.TINY_CONFIGS[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny_qwen35.TINY_CONFIGS, "device", (model_type, arch, {**kwargs, **SIZES}, options))
        hf, mtp = build_hf_model("device")
    arch, metadata, tensors = hf_to_gguf(hf, mtp, options)
    metadata[f"{arch}.full_attention_interval"] = SIZES["full_attention_interval"]
    types = {name: "Q8_0" if i % 2 else "Q4_0" for i, (name, t) in enumerate(sorted(tensors.items()))
             if t.dim() >= 2 and t.shape[-1] % 32 == 0}
    path = write_gguf(tmp_path_factory.mktemp("device") / f"{name}.gguf", arch=arch, metadata=metadata,
                      tensors=tensors, tensor_types=types)
    cpu = load(path, dtype="gguf", use_cache=False, tokenizer=False)
    dev = load(path, dtype="gguf", use_cache=False, tokenizer=False)
    dev.to_device("cpu")
    return cpu, dev


@pytest.fixture(scope="module", autouse=True)
def _triton_on():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_TRITON", "1")
        assert triton_dispatch._interpreting(), "triton was imported before TRITON_INTERPRET=1 was set"
        yield


@pytest.fixture(scope="module")
def trunks(tmp_path_factory):
    """The dense trunk with its file's MTP block: (on the CPU, placed)."""
    return _placed(tmp_path_factory, "dense_mtp")


@pytest.fixture(scope="module")
def moe_trunks(tmp_path_factory):
    return _placed(tmp_path_factory, "moe")


def test_the_states_are_placed_and_the_mtp_block_stays_on_the_cpu(trunks):
    _, dev = trunks
    seq = dev.new_sequence()
    assert [type(state) for state in dev._state(seq).layers] == [RecurrentState, PooledKVCache]
    dev.release(seq)
    assert dev._kv_pools[0] is None  # a pool for the attention layer only
    assert dev.model.layers[0].linear_attn.device_kernels
    assert dev.draft_head is not None and dev.draft_head.mtp is dev.mtp
    assert not any(getattr(m, "device_kernels", False) for m in dev.mtp.modules())  # the C kernels' CPU path


@pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: no C path to compare with")
@pytest.mark.parametrize("which", ["trunks", "moe_trunks"])
def test_plain_greedy_is_the_cpu_paths_within_rounding(which, request, monkeypatch):
    cpu, dev = request.getfixturevalue(which)
    want_tokens, want = greedy(cpu, PROMPT, 4)
    calls = count_device_kernels(monkeypatch)  # and no C kernel
    got_tokens, got = greedy(dev, PROMPT, 4)
    assert all(calls[name] for name in ("qmatmul", "attend", "rms_norm", "delta_rule", "lane_dot")), calls
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_moe_verify_rows_are_one_row_decodes(moe_trunks):
    assert_verify_rows_are_one_row_decodes(moe_trunks[1], PROMPT, prefix=12, max_rows=4)


def test_the_mtp_head_drafts_on_the_cpu_from_the_placed_trunk(trunks):
    """A draft step over the placed trunk's hidden rows is the CPU trunk's head's within the
    trunks' rounding; MTP-drafted greedy on the placed trunk gives the plain stream."""
    speculator = pytest.importorskip("verispec_mtp_nextn.speculator")
    cpu, dev = trunks
    drafts = []
    for trunk in (cpu, dev):
        seq = trunk.new_sequence()
        out = forward_one(trunk, seq, PROMPT, logits="last", hidden=True)
        trunk.release(seq)
        head = trunk.draft_head
        state = head.new_state()
        head.draft_catch_up(state, PROMPT, out.hidden, 0)
        drafts.append(head.draft_step(state, 17, out.hidden[-1], len(PROMPT))[0])
    torch.testing.assert_close(drafts[1], drafts[0], atol=ATOL, rtol=0)
    plain = run_greedy(cpu, PROMPT, 4)[0]  # the placed trunk's plain stream (test_plain_greedy_...)
    mtp = speculator.MtpSpeculator(dev.draft_head, max_draft_tokens=3, min_draft_prob=0.0)
    got, execution = run_greedy(dev, PROMPT, 4, mtp, max_draft_tokens=3)
    assert got == plain and execution.stats.num_draft_tokens > 0


class TestPlacedQwen35(PlacedTrunkSuite):
    prompt = verify_tokens = PROMPT
    verify_prefix, verify_rows = 10, 9
    speculative_steps = 8
    truncate = False  # recurrent state

    def speculator(self, trunk, plain):
        """Drafts from the plain stream with random accept counts (the random tiny model repeats
        too little for n-gram drafts to be accepted): full, partial and no acceptance, each kept."""
        import random

        from verispec.testing import oracle_speculator

        return oracle_speculator(plain, vocab_size=trunk.vocab_size, max_draft_tokens=4, rng=random.Random(0))
