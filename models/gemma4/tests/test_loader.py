"""The gemma4 table's alternative and optional rows through the real loader: llama.cpp also writes
experts as separate ffn_gate_exps / ffn_up_exps tensors, and files without layer_output_scale or
ffn_down_exps.scale (the module default, 1, is kept)."""
import pytest
import torch
from tiny_gemma import TINY_GEMMA4_MOE, gemma4_gguf_metadata, gemma4_gguf_tensors, make_hf_gemma4
from verispec.testing.fixture_writer import write_gguf
from verispec_gemma4.loader import load

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe():
    hf = make_hf_gemma4(TINY_GEMMA4_MOE)
    return hf.config, gemma4_gguf_tensors(hf)


def _load(tmp_path, config, tensors, name):
    path = write_gguf(tmp_path / name, arch="gemma4", metadata=gemma4_gguf_metadata(config), tensors=tensors)
    return load(path, dtype="float32", use_cache=False, tokenizer=False)


def test_split_gate_and_up_experts_load_as_the_fused_tensor(tmp_path, moe):
    config, tensors = moe
    split = dict(tensors)
    for i in range(config.num_hidden_layers):
        gate_up = split.pop(f"blk.{i}.ffn_gate_up_exps.weight")  # [E, 2·Fe, D]
        half = gate_up.shape[1] // 2
        split[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :half]
        split[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, half:]
    fused = _load(tmp_path, config, tensors, "fused.gguf").state_dict()
    got = _load(tmp_path, config, split, "split.gguf").state_dict()
    assert got.keys() == fused.keys()
    assert all(torch.equal(got[k], fused[k]) for k in fused)
    assert torch.equal(got["model.layers.2.experts.gate_up_proj.3.weight"],
                       tensors["blk.2.ffn_gate_up_exps.weight"][3])


def test_absent_layer_and_expert_scales_keep_the_default_one(tmp_path, moe):
    config, tensors = moe
    optional = ("layer_output_scale.weight", "ffn_down_exps.scale")
    state = _load(tmp_path, config, {k: v for k, v in tensors.items() if not k.endswith(optional)},
                  "unscaled.gguf").state_dict()
    for i in range(config.num_hidden_layers):
        assert torch.equal(state[f"model.layers.{i}.layer_scalar"], torch.ones(1))
        assert torch.equal(state[f"model.layers.{i}.router.per_expert_scale"], torch.ones(config.num_experts))
    scaled = _load(tmp_path, config, tensors, "scaled.gguf").state_dict()  # present: read, not the default
    assert torch.equal(scaled["model.layers.1.layer_scalar"], tensors["blk.1.layer_output_scale.weight"])
