"""The glm-dsa loader: which layers run their own indexer (the types array, the context-length
switch, llama.cpp's GLM-5.2 schedule), shared layers' indexer tensors ignored, and refusals."""
import pytest
import torch
from verispec.errors import UnusedTensors
from verispec.testing import forward_one
from verispec_glm5.loader_glm_dsa import load
from verispec_glm5.modeling_glm4moe import UnsupportedGlm4MoeVariant
from verispec_glm5.modeling_glm_dsa import GLM52_CONTEXT, default_indexer_types

pytest.importorskip("transformers")

#: llama.cpp src/models/glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES, its first 16 entries
LLAMA_CPP_GLM52 = (1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0)


def test_default_indexer_types_follow_llama_cpp():
    assert default_indexer_types(16, GLM52_CONTEXT) == tuple(bool(t) for t in LLAMA_CPP_GLM52)
    assert default_indexer_types(16, GLM52_CONTEXT - 1) == (True,) * 16  # GLM-5 / 5.1: all full


def _variant(tiny_dsa_fixture, tmp_path, name, **kwargs):
    import tiny_glm_dsa

    hf_model, mtp, _ = tiny_dsa_fixture(name)
    return tiny_glm_dsa.write_fixture(hf_model, tmp_path / "variant.gguf", mtp=mtp, **kwargs)


def test_context_switch_selects_the_glm52_schedule(tiny_dsa_fixture, tmp_path):
    """The 4-layer all-full file with context_length 1048576 and no types key: layer 3 becomes shared
    (llama.cpp's schedule); its indexer tensors stay in the file and are ignored."""
    path = _variant(tiny_dsa_fixture, tmp_path, "full",
                    extra_metadata={"glm-dsa.context_length": GLM52_CONTEXT})
    trunk = load(path, dtype="float32", use_cache=False, context_length=128)
    assert trunk.config.indexer_full == (True, True, True, False)
    assert trunk.model.layers[3].self_attn.indexer is None
    forward_one(trunk, trunk.new_sequence(), list(range(40)))  # layer 3 runs on layer 2's selection


def test_shared_layer_indexer_tensors_are_ignored_and_others_refused(tiny_dsa_fixture, tmp_path):
    """A GLM-5.2 file carrying indexer tensors on its shared layer 1 (as unsloth's do) loads and
    gives the same logits; an unrelated extra tensor is still refused."""
    hf_model, _, path = tiny_dsa_fixture("shared")
    carried = {f"blk.1.indexer.{n}": t for n, t in _indexer_tensors(hf_model).items()}
    plain = load(path, dtype="float32", use_cache=False)
    with_extra = load(_variant(tiny_dsa_fixture, tmp_path, "shared", extra_tensors=carried), dtype="float32",
                      use_cache=False)
    prompt = list(range(3, 43))
    assert torch.equal(forward_one(plain, plain.new_sequence(), prompt).logits,
                       forward_one(with_extra, with_extra.new_sequence(), prompt).logits)
    legacy = {"blk.0.attn_kv_b.weight": torch.zeros(4)}  # llama.cpp refuses it beside k_b / v_b too
    with pytest.raises(UnusedTensors, match="blk.0.attn_kv_b"):
        load(_variant(tiny_dsa_fixture, tmp_path, "shared", extra_tensors=legacy), dtype="float32", use_cache=False)


def _indexer_tensors(hf_model):
    indexer = hf_model.model.layers[0].self_attn.indexer
    return {"attn_q_b.weight": indexer.wq_b.weight.detach(), "attn_k.weight": indexer.wk.weight.detach(),
            "k_norm.weight": indexer.k_norm.weight.detach(), "k_norm.bias": indexer.k_norm.bias.detach(),
            "proj.weight": indexer.weights_proj.weight.detach()}


@pytest.mark.parametrize("types, message", [([False, True, True], "the first full"),
                                            ([True, False], "one entry per trunk layer")])
def test_bad_indexer_types_are_refused(tiny_dsa_fixture, tmp_path, types, message):
    path = _variant(tiny_dsa_fixture, tmp_path, "shared",
                    extra_metadata={"glm-dsa.attention.indexer.types": types})
    with pytest.raises(UnsupportedGlm4MoeVariant, match=message):
        load(path, dtype="float32", use_cache=False)


def test_a_file_without_the_selection_bias_routes_by_the_unbiased_scores(tmp_path):
    """exp_probs_b is optional for glm-dsa (llama.cpp): absent, the bias is zero, and the logits equal
    transformers' with its e_score_correction_bias zeroed."""
    import tiny_glm_dsa

    hf_model, _ = tiny_glm_dsa.build_hf_model("full")
    with torch.no_grad():
        for layer in hf_model.model.layers[hf_model.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    _, _, tensors = tiny_glm_dsa.hf_to_gguf(hf_model)
    path = tiny_glm_dsa.write_fixture(hf_model, tmp_path / "nobias.gguf",
                                      drop_tensors=[t for t in tensors if "exp_probs_b" in t])
    trunk = load(path, dtype="float32", use_cache=False)
    prompt = torch.arange(5, 45)
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0]
    torch.testing.assert_close(forward_one(trunk, trunk.new_sequence(), prompt.tolist()).logits, expected,
                               atol=1e-4, rtol=0)
