"""The glm4moe loader: what it reads from the file, the layouts llama.cpp also accepts, and the
variants it refuses with an error naming the fix."""
import pytest
import torch
from tiny_glm4moe import hf_to_gguf, write_fixture
from verispec.errors import UnusedTensors
from verispec.testing import forward_one
from verispec_glm5.loader import load
from verispec_glm5.modeling_glm4moe import UnsupportedGlm4MoeVariant

pytest.importorskip("transformers")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def test_config_reads_the_files_keys(tiny_fixture):
    hf_model, _, path = tiny_fixture("grouped")
    c, h = load(path, dtype="float32").config, hf_model.config
    assert (c.num_hidden_layers, c.first_k_dense_replace, c.n_routed_experts, c.num_experts_per_tok,
            c.n_group, c.topk_group, c.n_shared_experts, c.moe_intermediate_size) == (4, 2, 8, 3, 4, 2, 2, 19)
    assert (c.rotary_dim, c.head_dim, c.use_qk_norm, c.attention_bias,
            c.tie_word_embeddings) == (10, 20, False, True, True)
    assert c.norm_topk_prob is False and c.routed_scaling_factor == h.routed_scaling_factor
    nextn = load(tiny_fixture("nextn")[2], dtype="float32")
    assert nextn.config.num_nextn_predict_layers == 1 and nextn.num_layers == 3 and nextn.config.use_qk_norm


def test_registered_through_the_entry_point():
    from verispec.registry import Registry

    spec = Registry.discover().trunk_for_architecture("glm4moe")
    assert spec.loader == "verispec_glm5.loader:load"


def _variant(tiny_fixture, tmp_path, name="nextn", **changes):
    hf_model, mtp, _ = tiny_fixture(name)
    return write_fixture(hf_model, tmp_path / "variant.gguf", mtp=mtp, **changes)


def _logits(path):
    trunk = load(path, dtype="float32", use_cache=False)
    return forward_one(trunk, trunk.new_sequence(), PROMPT).logits


def test_fused_attn_qkv_and_per_layer_arrays_load_the_same_model(tiny_fixture, tmp_path):
    """llama.cpp's alternative layouts: one attn_qkv tensor (+ bias) per layer, and head_count_kv /
    feed_forward_length as arrays of block_count entries."""
    hf_model, mtp, path = tiny_fixture("nextn")
    _, metadata, tensors = hf_to_gguf(hf_model, mtp)
    fused, drop = {}, []
    for i in range(4):
        for suffix in ("weight", "bias"):
            parts = [f"blk.{i}.attn_{p}.{suffix}" for p in "qkv"]
            fused[f"blk.{i}.attn_qkv.{suffix}"] = torch.cat([tensors[p] for p in parts])
            drop += parts
    arrays = {"glm4moe.attention.head_count_kv": [1] * 4, "glm4moe.feed_forward_length": [37] * 4}
    variant = write_fixture(hf_model, tmp_path / "fused.gguf", mtp=mtp, extra_tensors=fused,
                            drop_tensors=drop, extra_metadata=arrays)
    assert torch.equal(_logits(variant), _logits(path))
    assert load(variant, dtype="float32", use_cache=False).draft_head is not None


def test_missing_shared_head_norm_falls_back_to_output_norm(tiny_fixture, tmp_path):
    path = _variant(tiny_fixture, tmp_path, drop_tensors=["blk.3.nextn.shared_head_norm.weight"])
    trunk = load(path, dtype="float32", use_cache=False)
    assert torch.equal(trunk.mtp.post_norm.weight, trunk.model.norm.weight)


@pytest.mark.parametrize("changes, match", [
    ({"extra_metadata": {"glm4moe.expert_gating_func": 1}}, "expert_gating_func = 1"),
    ({"extra_metadata": {"glm4moe.rope.dimension_sections": [4, 4, 2, 0]}}, "M-RoPE"),
    ({"extra_metadata": {"glm4moe.nextn_predict_layers": 2}}, "2 NextN blocks"),
    ({"drop_tensors": ["blk.3.nextn.eh_proj.weight"]}, "without blk.3.nextn.eh_proj.weight"),
])
def test_variants_are_refused_naming_the_fix(tiny_fixture, tmp_path, changes, match):
    with pytest.raises(UnsupportedGlm4MoeVariant, match=match):
        load(_variant(tiny_fixture, tmp_path, **changes), use_cache=False)


def test_a_tensor_the_math_would_not_read_is_refused(tiny_fixture, tmp_path):
    path = _variant(tiny_fixture, tmp_path, extra_tensors={"blk.1.ffn_gate_inp_shexp.weight": torch.ones(48)})
    with pytest.raises(UnusedTensors, match="ffn_gate_inp_shexp"):
        load(path, use_cache=False)


def test_an_mtp_only_file_is_refused(tiny_fixture, tmp_path):
    hf_model, mtp, _ = tiny_fixture("nextn")
    _, _, tensors = hf_to_gguf(hf_model, mtp)
    keep = ("token_embd.weight", "output_norm.weight", "output.weight")
    path = write_fixture(hf_model, tmp_path / "mtp-only.gguf", mtp=mtp,
                         drop_tensors=[k for k in tensors if not (k.startswith("blk.3.") or k in keep)])
    with pytest.raises(UnsupportedGlm4MoeVariant, match="an MTP-only file"):
        load(path, use_cache=False)


def test_a_declared_nextn_block_that_is_absent_is_refused_as_such(tiny_fixture, tmp_path):
    """llama.cpp loads a file declaring nextn_predict_layers without the block as trunk-only; this
    loader asks for the key to be dropped instead (not a misleading "damaged file")."""
    hf_model, _, _ = tiny_fixture("grouped")
    path = write_fixture(hf_model, tmp_path / "declared.gguf",
                         extra_metadata={"glm4moe.nextn_predict_layers": 1, "glm4moe.block_count": 5})
    with pytest.raises(UnsupportedGlm4MoeVariant, match="drop the key"):
        load(path, use_cache=False)
