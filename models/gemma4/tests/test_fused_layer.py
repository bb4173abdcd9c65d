"""Gemma 3's fused decoder layer (verispec.nn.layers, layers.c) gives the op-by-op forward's bits:
a tiny Gemma 3 with quantised linears of several GGUF types, in the `gguf` weight mode, sliding
and full layers, through a prefill longer than the window (chunked), decodes and a verify, with
the fused path checked to have run; and the real 270M when it is installed."""
import pytest
from tiny_gemma import gemma3_gguf_tensors, make_hf_gemma3, token_ids, write_gemma3_gguf
from verispec.kernels import ckernels
from verispec.testing import real_checkpoint
from verispec.testing.gguf_weights import assert_fused_layers_are_op_by_op
from verispec_gemma4.loader import load

pytestmark = pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: the kernels are not built")

#: linear widths multiples of 32 (a block); sliding window 8, layers 0-4 sliding, 5 full, 6 sliding
SIZES = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1}
TYPES = {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    hf = make_hf_gemma3(**SIZES)
    names = gemma3_gguf_tensors(hf)
    types = {n: TYPES[n.split(".")[2]] for n in names if n.startswith("blk.") and n.split(".")[2] in TYPES}
    path = write_gemma3_gguf(tmp_path_factory.mktemp("fused") / "q.gguf", hf, tensor_types=types)
    return load(path, dtype="gguf", use_cache=False, tokenizer=False, max_rows_per_forward=16, max_verify_rows=16)


def test_the_fused_layer_is_the_op_by_op_layer_bitwise(trunk):
    assert_fused_layers_are_op_by_op(trunk, token_ids(60).tolist(), prefill=40)  # 16-row chunks past the window


@pytest.mark.real_checkpoint
def test_the_real_270m_fused_is_op_by_op_bitwise():
    from verispec.api import load_registered_trunk
    from verispec.registry import Registry

    trunk = load_registered_trunk(real_checkpoint("gemma3-270m"), Registry.discover(), dtype="gguf")
    assert_fused_layers_are_op_by_op(trunk, trunk.tokenizer.encode(" ".join(["The tide came in over the stones."] * 12)),
                                     prefill=70)
