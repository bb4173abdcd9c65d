"""Loading: the fixture's names against gguf-py's (llama.cpp's converter names), config from
metadata, file variants, and clear errors on bad input."""
import re

import pytest
import torch
from tiny_qwen35 import TINY_CONFIGS, build_hf_model, hf_to_gguf, write_fixture
from verispec.errors import UnsupportedArchitecture, UnusedTensors
from verispec.gguf.io import GGUFFile, MissingTensor
from verispec_qwen35.loader import config_from_gguf, load
from verispec_qwen35.modeling_qwen35 import FULL_ATTENTION, LINEAR_ATTENTION, UnsupportedQwen35Variant

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["dense_mtp", "moe_fused_mtp", "moe"])
def test_fixture_names_are_gguf_pys(name):
    """Every tensor and key the test map writes is one gguf-py 0.19 names for the architecture
    (MODEL_TENSORS / Keys), except the NextN rows it does not list yet (docs/reference/qwen35.md §3.7)."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, Keys

    hf_model, mtp = build_hf_model(name)
    arch, metadata, tensors = hf_to_gguf(hf_model, mtp, TINY_CONFIGS[name][3])
    model_arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    templates = [re.escape(TENSOR_NAMES[t]).replace(r"\{bid\}", r"\d+") for t in MODEL_TENSORS[model_arch]]
    for tensor in tensors:
        base = re.sub(r"\.(weight|bias)$", "", tensor)
        assert ".nextn." in base or any(re.fullmatch(t, base) for t in templates), tensor
    key_templates = {v.replace("{arch}", arch) for group in vars(Keys).values() if isinstance(group, type)
                     for v in vars(group).values() if isinstance(v, str) and "{arch}" in v}
    unknown = set(metadata) - key_templates - {f"{arch}.attention.recurrent_layers"}
    assert not unknown


def test_config_from_metadata(tiny_fixture):
    _, _, path = tiny_fixture("moe_fused_mtp")
    config = config_from_gguf(GGUFFile.open(path))
    assert config.num_hidden_layers == 4 and config.num_mtp_layers == 1  # block_count 5 = 4 + MTP
    assert config.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 6)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (8, 12)
    assert config.rotary_dim == 8 and config.head_dim == 32
    assert (config.num_experts, config.num_experts_per_tok) == (5, 2)
    assert config.shared_expert_gate_shape == (1, 48)


def test_recurrent_layers_key_overrides_the_interval(tiny_fixture, tmp_path):
    hf_model, _, _ = tiny_fixture("dense")
    import numpy as np

    flags = np.array([True, False, True, False], dtype=np.bool_)
    path = write_fixture(hf_model, tmp_path / "r.gguf",
                         extra_metadata={"qwen35.attention.recurrent_layers": flags})
    config = config_from_gguf(GGUFFile.open(path))
    assert config.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION)


def test_bad_files_raise_named_errors(tiny_fixture, tmp_path):
    hf_model, mtp, _ = tiny_fixture("dense_mtp")
    missing = write_fixture(hf_model, tmp_path / "missing.gguf", drop_tensors=("blk.1.ssm_a",))
    with pytest.raises(MissingTensor, match="blk.1.ssm_a"):
        load(missing, dtype="float32", use_cache=False)
    extra = write_fixture(hf_model, tmp_path / "extra.gguf",
                          extra_tensors={"blk.0.ffn_gate_inp.weight": torch.ones(5, 48)})
    with pytest.raises(UnusedTensors, match=r"\['blk.0.ffn_gate_inp.weight'\]"):
        load(extra, dtype="float32", use_cache=False)
    nxt = write_fixture(hf_model, tmp_path / "next.gguf",
                        extra_tensors={"blk.0.ssm_ba.weight": torch.ones(12, 48)})
    with pytest.raises(UnsupportedQwen35Variant, match="qwen3next"):
        load(nxt, dtype="float32", use_cache=False)
    arch, metadata, tensors = hf_to_gguf(hf_model, mtp)
    from verispec.testing.fixture_writer import write_gguf

    mtp_only = {k: v for k, v in tensors.items() if k.startswith("blk.4.") or not k.startswith("blk.")}
    path = write_gguf(tmp_path / "mtp-only.gguf", arch=arch, metadata=metadata, tensors=mtp_only)
    with pytest.raises(UnsupportedQwen35Variant, match="standalone MTP"):
        load(path, dtype="float32", use_cache=False)
    wrong = write_gguf(tmp_path / "llama.gguf", arch="llama", metadata={},
                       tensors={"token_embd.weight": torch.ones(4, 4)},
                       vocab=None)
    with pytest.raises(UnsupportedArchitecture, match="'llama' GGUF"):
        load(wrong, dtype="float32", use_cache=False)


def test_registered_for_both_architectures():
    from verispec.registry import Registry
    from verispec_qwen35 import hooks

    registry = Registry.from_plugins({"qwen35": hooks})
    specs = {arch for entry in registry.trunks.values() for arch in entry.spec.architectures}
    assert specs == {"qwen35", "qwen35moe"}
