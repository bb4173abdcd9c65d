"""The `gguf` weight mode on glm5-next: KDA, MLA, indexer, FFN and expert linears stored in block
types run on the file's own quantised values, and a k-row verify is bitwise the one-row decodes (the
trunk declares `spec_batch_invariant` in this mode); conv, k_b / v_b, mHC, norms and the router stay
fp32."""
import pytest
import torch
from tiny_glm5next import build_hf_model, hf_to_gguf, write_fixture
from verispec.seams import declared
from verispec.testing import TrunkConformance, teacher_forced_logits
from verispec.testing.gguf_weights import (assert_file_block_tensors_exact,
                                           assert_verify_rows_are_one_row_decodes)
from verispec_glm5.loader_glm5next import load

pytest.importorskip("transformers")

#: suffix -> block type: KDA Q8_0 (q / k / v) and Q5_1 (gates), MLA Q8_0, indexer Q5_0, dense FFN
#: Q5_0, experts (3-D) Q4_0, shared expert Q4_1
TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0",
         "ssm_f_a.weight": "Q5_1", "ssm_f_b.weight": "Q5_1", "ssm_beta.weight": "Q5_1",
         "ssm_g_a.weight": "Q5_1", "ssm_g_b.weight": "Q5_1",
         "attn_q_a.weight": "Q8_0", "attn_q_b.weight": "Q8_0", "attn_kv_a_mqa.weight": "Q8_0",
         "attn_output.weight": "Q8_0", "indexer.attn_q_b.weight": "Q5_0", "indexer.attn_k.weight": "Q5_0",
         "indexer.proj.weight": "Q5_0", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0",
         "ffn_down.weight": "Q5_0", "ffn_gate_exps.weight": "Q4_0", "ffn_up_exps.weight": "Q4_0",
         "ffn_down_exps.weight": "Q4_0", "ffn_gate_shexp.weight": "Q4_1", "ffn_up_shexp.weight": "Q4_1",
         "ffn_down_shexp.weight": "Q4_1", "nextn.eh_proj.weight": "Q8_0", "output.weight": "Q8_0"}
PROMPT = list(range(7, 39))  # past index_topk (16 = 4 pools of 4)


@pytest.fixture(scope="module")
def blocks_path(tmp_path_factory):
    model = build_hf_model("blocks")
    _, _, tensors = hf_to_gguf(model)
    suffixes = {name: name.split(".", 2)[-1] if name.startswith("blk.") else name for name in tensors}
    types = {name: TYPES[suffix] for name, suffix in suffixes.items() if suffix in TYPES}
    assert {"Q4_0", "Q5_1"} <= set(types.values()) and len(types) > 40
    return write_fixture(model, tmp_path_factory.mktemp("g5n-blocks") / "q.gguf", tensor_types=types)


def test_block_tensors_are_the_files_own_values(blocks_path):
    checked = assert_file_block_tensors_exact(blocks_path)
    assert {"Q8_0", "Q5_0", "Q5_1", "Q4_1"} <= set(checked)


def test_gguf_mode_verify_rows_are_one_row_decodes(blocks_path):
    trunk = load(blocks_path, dtype="gguf", use_cache=False)
    assert declared(trunk, "spec_batch_invariant")
    tokens = torch.randint(0, trunk.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_verify_rows_are_one_row_decodes(trunk, tokens, prefix=28, max_rows=9)


def test_gguf_mode_is_close_to_the_dequantised_float_model(blocks_path):
    """Activations quantised to int8 per 32 columns by the block kernel: logits near the fp32 run
    of the same dequantised weights, greedy mostly the same. The KDA gates (exp of a projection),
    the mHC mixes and the swiglu clamp amplify rounding more than glm-dsa's plain residuals, and a
    routing or pool top-k near-tie can move a row, so the bound is looser than glm-dsa's and is
    checked against the int8 weight-only mode's distance on the same tokens (measured: median
    row error 0.050 of the logit scale in gguf mode, 0.079 in int8 mode; greedy 85% vs 69% equal)."""
    tokens = torch.randint(0, 160, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    blocks = teacher_forced_logits(load(blocks_path, dtype="gguf", use_cache=False), tokens)
    int8 = teacher_forced_logits(load(blocks_path, dtype="int8", use_cache=False), tokens)
    floats = teacher_forced_logits(load(blocks_path, dtype="float32", use_cache=False), tokens)
    per_row = (blocks - floats).abs().amax(dim=-1)  # [48]
    scale = floats.abs().max()
    assert per_row.median() < 0.08 * scale
    assert per_row.median() <= (int8 - floats).abs().amax(dim=-1).median()
    assert (per_row > 0.25 * scale).sum() <= len(tokens) // 8
    assert (blocks.argmax(-1) == floats.argmax(-1)).float().mean() >= 0.75


class TestGgufModeConformance(TrunkConformance):
    prompt = PROMPT

    @pytest.fixture
    def trunk(self, blocks_path):
        return load(blocks_path, dtype="gguf", use_cache=False)
