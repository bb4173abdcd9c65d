"""The glm5-next loader: the NextN block becomes the draft head, not a trunk layer; the variants
whose math differs are refused with the key that makes them so."""
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


def test_the_fixture_module_writes_a_gguf_from_the_command_line(tmp_path):
    """`python tiny_glm5next.py NAME OUT.gguf` writes the fixture and prints its path, as
    tiny_glm4moe.py and tiny_glm_dsa.py do (the README's recipe for a `verispec generate` model)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "flash.gguf"
    r = subprocess.run([sys.executable, tiny_glm5next.__file__, "flash", str(out)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert load(str(out), dtype="float32").draft_head is not None


def test_the_nextn_block_is_the_head_not_a_trunk_layer(tiny_glm5next_fixture, tmp_path):
    """The fixture's blk.4 is its NextN block: the trunk is blocks 0..3 with a draft head; without
    the block (and its key) the same trunk loads with no head and the same logits; a stray tensor
    is refused."""
    hf_model, path = tiny_glm5next_fixture("flash")
    with_nextn = load(path, dtype="float32")
    assert with_nextn.num_layers == 4 and with_nextn.draft_head is not None
    _, md, ts = tiny_glm5next.hf_to_gguf(hf_model)
    trunk_only = write_gguf(tmp_path / "trunk.gguf", arch=A,
                            metadata={**md, f"{A}.block_count": 4, f"{A}.nextn_predict_layers": 0},
                            tensors={k: v for k, v in ts.items() if not k.startswith("blk.4.")})
    trunk = load(trunk_only, dtype="float32")
    assert trunk.draft_head is None
    tokens = list(range(1, 30))
    assert torch.equal(forward_one(with_nextn, with_nextn.new_sequence(), tokens).logits,
                       forward_one(trunk, trunk.new_sequence(), tokens).logits)
    with pytest.raises(UnusedTensors):
        load(_write(hf_model, tmp_path / "stray.gguf", tensors={"blk.0.ssm_stray.weight": torch.ones(3)}))


@pytest.mark.parametrize(("key", "value", "names"), [
    ("rope.dimension_count", 8, "rope.dimension_count"),
    ("hyper_connection.count", 2, "hyper_connection.count"),
    ("attention.indexer.kpool", 3, "kpool"),
    ("attention.indexer.types", [True, False, True, True, True], "indexer.types"),
    ("expert_gating_func", 1, "expert_gating_func"),
])
def test_variants_are_refused_naming_the_key(tiny_glm5next_fixture, tmp_path, key, value, names):
    hf_model, _ = tiny_glm5next_fixture("flash")
    with pytest.raises(UnsupportedGlm4MoeVariant, match=names):
        load(_write(hf_model, tmp_path / "bad.gguf", metadata={f"{A}.{key}": value}))
