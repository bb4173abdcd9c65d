"""The `gguf` weight mode on each architecture: the linears and experts stored in block types
(`glm_archs.GgufMode.types`: attention / MLA / KDA, indexer, FFN, experts) run on the file's own
quantised values (bitwise gguf-py's dequantisation), and a k-row verify is bitwise the one-row
decodes (the trunk declares `spec_batch_invariant` in this mode); glm-dsa's and glm5-next's k_b /
v_b, conv, mHC, norms and the router stay fp32."""
import pytest
import torch
from glm_archs import ARCHS, block_types
from verispec.seams import declared
from verispec.testing import TrunkConformance, teacher_forced_logits
from verispec.testing.gguf_weights import assert_file_block_tensors_exact, assert_verify_rows_are_one_row_decodes

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(ARCHS))
def blocks(request, tmp_path_factory):
    """(the architecture, its "blocks" model written with block-typed tensors)."""
    arch = ARCHS[request.param]
    model, mtp = arch.build("blocks")
    _, _, tensors = arch.hf_to_gguf(model, mtp)
    types = block_types(arch.gguf.types, tensors)
    assert set(types.values()) == set(arch.gguf.types.values()) and len(types) > arch.gguf.min_typed
    path = arch.write(model, mtp, tmp_path_factory.mktemp(f"{arch.name}-blocks") / "q.gguf", tensor_types=types)
    return arch, path


def test_block_tensors_are_the_files_own_values(blocks):
    arch, path = blocks
    checked = assert_file_block_tensors_exact(path)
    assert arch.gguf.checked <= set(checked)


def test_gguf_mode_verify_rows_are_one_row_decodes(blocks):
    arch, path = blocks
    trunk = arch.load(path, dtype="gguf", use_cache=False)
    assert declared(trunk, "spec_batch_invariant")
    tokens = torch.randint(0, trunk.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_verify_rows_are_one_row_decodes(trunk, tokens, prefix=arch.gguf.verify_prefix, max_rows=9)


def test_gguf_mode_is_close_to_the_dequantised_float_model(blocks):
    """The block kernel quantises activations to int8 per 32 columns (llama.cpp's q8_0 rule): the
    logits stay near the fp32 run of the same dequantised weights, and greedy mostly agrees. A row
    whose routing (or top-k) sits at a near-tie can take another expert and move far (measured on
    glm4moe: 47 of 48 rows within 0.46 of logits up to 9, one row 3.5 off; argmax 94 %).
    glm5-next's bounds are looser and held against the int8 mode's (`glm_archs`)."""
    arch, path = blocks
    mode = arch.gguf
    tokens = torch.randint(0, 160, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    gguf = teacher_forced_logits(arch.load(path, dtype="gguf", use_cache=False), tokens)
    floats = teacher_forced_logits(arch.load(path, dtype="float32", use_cache=False), tokens)
    per_row = (gguf - floats).abs().amax(dim=-1)  # [48]
    scale = floats.abs().max()
    assert per_row.median() < mode.median * scale
    if mode.beats_int8:
        int8 = teacher_forced_logits(arch.load(path, dtype="int8", use_cache=False), tokens)
        assert per_row.median() <= (int8 - floats).abs().amax(dim=-1).median()
    assert (per_row > mode.far * scale).sum() <= len(tokens) // 8
    assert (gguf.argmax(-1) == floats.argmax(-1)).float().mean() >= mode.argmax


class TestGgufModeConformance(TrunkConformance):
    @pytest.fixture
    def trunk(self, blocks):
        arch, path = blocks
        self.prompt = arch.gguf.prompt  # the suite reads self.prompt (a per-architecture length)
        return arch.load(path, dtype="gguf", use_cache=False)
