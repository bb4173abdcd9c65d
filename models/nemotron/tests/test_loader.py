"""The loader's own duties: what it refuses (with the reason), optional tensors (conv bias, a
tied head), options, every weight dtype, and a hook module that stays light."""
import subprocess
import sys

import pytest
import torch
from tiny_nemotron import build_hf_model, write_fixture
from verispec.errors import UnusedTensors
from verispec.gguf.io import BadTensorShape, GGUFFile, MissingKey, MissingTensor
from verispec.weights.quant import WEIGHT_DTYPES
from verispec.seams import ContextOverflow
from verispec.testing import forward_one, plain_logits
from verispec_nemotron.loader import load
from verispec_nemotron.modeling_nemotron_h import NemotronHConfig, UnsupportedNemotronVariant

pytest.importorskip("transformers")


def _metadata_and_shapes(path):
    gguf = GGUFFile.open(path)
    return dict(gguf.metadata), {name: gguf.tensor_info(name).shape for name in gguf}


@pytest.mark.parametrize("name, change, error, match", [
    ("dense", {"general.architecture": "mamba2"}, UnsupportedNemotronVariant, "mamba2"),
    ("dense", {"nemotron_h.nextn_predict_layers": 1}, UnsupportedNemotronVariant, "MTP"),
    ("moe", {"nemotron_h_moe.moe_latent_size": 16}, UnsupportedNemotronVariant, "latent MoE"),
    ("moe", {"nemotron_h_moe.expert_group_count": 2}, UnsupportedNemotronVariant, "1 group"),
    ("moe", {"nemotron_h_moe.expert_used_count": [2, 2, 0, 2, 3]}, UnsupportedNemotronVariant,
     "same expert count"),
    ("dense", {"nemotron_h.attention.head_count_kv": [0, 1, 0]}, UnsupportedNemotronVariant,
     "3 entries for 5"),
    ("dense", {"nemotron_h.feed_forward_length": [0, 40, 40, 0, 40]}, UnsupportedNemotronVariant,
     "one mixer"),
    ("dense", {"nemotron_h.ssm.group_count": 3}, UnsupportedNemotronVariant, "split into heads"),
    ("dense", {"nemotron_h.attention.value_length": 8}, UnsupportedNemotronVariant, "K/V head sizes"),
    ("dense", {"nemotron_h.ssm.state_size": None}, MissingKey, "nemotron_h.ssm.state_size"),
])
def test_config_refuses_what_it_cannot_compute(tiny_fixture, name, change, error, match):
    metadata, shapes = _metadata_and_shapes(tiny_fixture(name)[1])
    for key, value in change.items():
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value
    with pytest.raises(error, match=match):
        NemotronHConfig.from_gguf(metadata, shapes)


def test_block_pattern_and_sizes_come_from_the_file(tiny_fixture):
    metadata, shapes = _metadata_and_shapes(tiny_fixture("moe")[1])
    config = NemotronHConfig.from_gguf(metadata, shapes)
    assert config.layer_types == ("mamba", "moe", "attention", "mamba", "moe")
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.moe_shared_expert_intermediate_size, config.routed_scaling_factor) == (6, 2, 24, 32, 2.5)
    assert (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.conv_dim) == (6, 8, 3, 96)
    metadata["nemotron_h_moe.attention.layer_norm_rms_epsilon"] = 1e-6  # preferred when present
    assert NemotronHConfig.from_gguf(metadata, shapes).layer_norm_epsilon == pytest.approx(1e-6)


@pytest.fixture(scope="module")
def dense_model():
    return build_hf_model("dense")


@pytest.mark.parametrize("variant, error, match", [
    ({"extra_tensors": {"blk.1.attn_q.bias": torch.zeros(48)}}, UnusedTensors, "does not use"),
    ({"drop": ("blk.0.ssm_out.weight",)}, MissingTensor, "blk.0.ssm_out.weight"),
    ({"extra_tensors": {"blk.3.ssm_norm.weight": torch.ones(48)}}, BadTensorShape, "blk.3.ssm_norm.weight"),
])
def test_files_with_wrong_tensors_are_refused(dense_model, tmp_path, variant, error, match):
    with pytest.raises(error, match=match):
        load(write_fixture(dense_model, tmp_path / "variant.gguf", **variant), dtype="float32",
             use_cache=False)


def _assert_parity(hf_model, path):
    ours = load(path, dtype="float32", use_cache=False, tokenizer=False)
    prompt = torch.randint(0, ours.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = forward_one(ours, ours.new_sequence(), prompt).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    return ours


def test_a_file_without_conv_bias_or_output_loads_and_matches(tmp_path):
    """ssm_conv1d.bias is optional in llama.cpp; without output.weight the head is tied."""
    hf_model = build_hf_model("dense", seed=5)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.conv1d.bias.zero_()
        hf_model.lm_head.weight.copy_(hf_model.model.embeddings.weight)
    drop = ("output.weight", "blk.0.ssm_conv1d.bias", "blk.3.ssm_conv1d.bias")
    ours = _assert_parity(hf_model, write_fixture(hf_model, tmp_path / "no-bias.gguf", drop=drop))
    assert not ours.config.use_conv_bias and ours.config.tie_word_embeddings and ours.lm_head is None


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_every_weight_dtype_loads_and_decodes_like_its_prefill(tiny_fixture, dtype):
    _, path = tiny_fixture("moe")
    ours = load(path, dtype=dtype, use_cache=False, tokenizer=False)
    tokens = [4, 8, 15, 16, 23, 42, 99, 7]
    prefill = forward_one(ours, ours.new_sequence(), tokens).logits
    assert prefill.shape == (len(tokens), ours.vocab_size) and torch.isfinite(prefill).all()
    if ours.spec_batch_invariant:
        assert torch.equal(prefill, plain_logits(ours, tokens))


def test_context_length_option_and_the_tokenizer(tiny_fixture):
    _, path = tiny_fixture("dense")
    model = load(path, context_length=20, use_cache=False)
    assert model.max_context_length == 20 and model.tokenizer is not None
    seq = model.new_sequence()
    forward_one(model, seq, range(20), logits="last")
    with pytest.raises(ContextOverflow):
        forward_one(model, seq, [1], logits="last")
    assert model.seq_len(seq) == 20  # nothing written
    assert load(path, use_cache=False, tokenizer=False).max_context_length == 512  # the file's context_length


def test_hooks_register_without_importing_torch():
    code = ("import sys; from verispec_nemotron import hooks; specs = []; "
            "hooks.register_trunks(specs.append); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(specs[0].architectures)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('nemotron_h', 'nemotron_h_moe')"
