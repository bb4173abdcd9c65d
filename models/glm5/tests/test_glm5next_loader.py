"""The glm5-next loader: a NextN block is ignored (the trunk is the blocks before it), the
variants whose math differs are refused with the key that makes them so."""
import pytest
import tiny_glm5next
import torch
from verispec.errors import UnusedTensors
from verispec.testing import forward_one
from verispec.testing.fixture_writer import write_gguf
from verispec_glm5.loader_glm5next import load
from verispec_glm5.modeling_glm4moe import UnsupportedGlm4MoeVariant

pytest.importorskip("transformers")

A = "glm5-next"


def _write(hf_model, path, *, metadata=None, tensors=None):
    arch, md, ts = tiny_glm5next.hf_to_gguf(hf_model)
    return write_gguf(path, arch=arch, metadata={**md, **(metadata or {})}, tensors={**ts, **(tensors or {})})


def test_a_nextn_block_is_ignored(tiny_glm5next_fixture, tmp_path):
    """Block 3 (MLA + MoE) declared the NextN block with its nextn.* tensors: the trunk is blocks
    0..2, whose logits equal the 3-block file's; a stray tensor elsewhere is still refused."""
    hf_model, path = tiny_glm5next_fixture("flash")
    d = hf_model.config.hidden_size
    nextn = {"blk.3.nextn.eh_proj.weight": torch.randn(d, 2 * d), "blk.3.nextn.enorm.weight": torch.ones(d),
             "blk.3.nextn.hnorm.weight": torch.ones(d), "blk.3.nextn.shared_head_norm.weight": torch.ones(d)}
    with_nextn = load(_write(hf_model, tmp_path / "nextn.gguf", metadata={f"{A}.nextn_predict_layers": 1},
                             tensors=nextn), dtype="float32")
    assert with_nextn.num_layers == 3 and with_nextn.config.kda_layers == (True, False, True)
    _, md, ts = tiny_glm5next.hf_to_gguf(hf_model)
    three = write_gguf(tmp_path / "three.gguf", arch=A, metadata={**md, f"{A}.block_count": 3},
                       tensors={k: v for k, v in ts.items() if not k.startswith("blk.3.")})
    trunk = load(three, dtype="float32")
    tokens = list(range(1, 30))
    assert torch.equal(forward_one(with_nextn, with_nextn.new_sequence(), tokens).logits,
                       forward_one(trunk, trunk.new_sequence(), tokens).logits)
    with pytest.raises(UnusedTensors):
        load(_write(hf_model, tmp_path / "stray.gguf", tensors={"blk.0.ssm_stray.weight": torch.ones(3)}))


@pytest.mark.parametrize(("key", "value", "names"), [
    ("rope.dimension_count", 8, "rope.dimension_count"),
    ("hyper_connection.count", 2, "hyper_connection.count"),
    ("attention.indexer.kpool", 3, "kpool"),
    ("attention.indexer.types", [True, False, True, True], "indexer.types"),
    ("expert_gating_func", 1, "expert_gating_func"),
])
def test_variants_are_refused_naming_the_key(tiny_glm5next_fixture, tmp_path, key, value, names):
    hf_model, _ = tiny_glm5next_fixture("flash")
    with pytest.raises(UnsupportedGlm4MoeVariant, match=names):
        load(_write(hf_model, tmp_path / "bad.gguf", metadata={f"{A}.{key}": value}))
