"""The eagle3 GGUF contract: our writer's file read back, and every refusal a VerispecError naming the
mismatch and the fix (binding: trunk family, target hidden size, layer ids past the trunk's depth,
widths, vocabulary, d2t out of range or duplicated, tokenizer; format: tap count, block count, a d2t
that is not I64, tensors the math does not read)."""
from __future__ import annotations

import pytest
import torch
from tiny_eagle3 import TARGET, head_tensors, write_head
from verispec.errors import UnusedTensors, VerispecError
from verispec.seams import DrafterMismatch
from verispec.testing import ToyTrunk
from verispec.testing.fixture_writer import byte_level_vocab
from verispec_eagle3.binding import binding_problem
from verispec_eagle3.config import UnsupportedEagle3
from verispec_eagle3.loader import load, read_config


def test_written_file_reads_back(tmp_path):
    tensors, d2t = head_tensors(own_embedding=True, norm_before_fc=True, rope_freqs=True)
    path = write_head(tmp_path / "h.gguf", tensors, d2t, norm_before_residual=True, norm_before_fc=True)
    gguf, config = read_config(path)
    assert config.target_layers == (1, 2, 4) and config.target_hidden_size == 48
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (48, 4, 2, 12)
    assert config.norm_before_residual and config.norm_before_fc and config.own_embedding and config.own_output
    assert config.draft_vocab_size == 40 and config.embedding_rows == TARGET["vocab_size"]
    assert gguf.tensor("d2t").dtype == torch.int64 and torch.equal(gguf.tensor("d2t"), d2t)
    for name, tensor in tensors.items():
        assert torch.equal(gguf.tensor(name), tensor.float()), name


def test_older_extract_layers_key_is_read(tmp_path):
    tensors, d2t = head_tensors()
    path = write_head(tmp_path / "h.gguf", tensors, d2t,
                      extra_metadata={"eagle3.target_layers": None, "eagle3.extract_layers": [0, 2, 3]})
    assert read_config(path)[1].target_layers == (0, 2, 3)


def _mismatch(target, path, *needles):
    with pytest.raises(DrafterMismatch) as info:
        load(path, target[2])
    message = str(info.value)
    assert isinstance(info.value, VerispecError) and "pass an EAGLE-3 head made for this model" in message
    for needle in needles:
        assert needle in message, message
    return message


def test_refuses_another_target_hidden_size(target, tmp_path):
    tensors, d2t = head_tensors(target_hidden=40)
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t), "3 trunk rows of 40", "48 wide")


def test_refuses_layer_ids_past_the_trunks_depth(target, tmp_path):
    tensors, d2t = head_tensors()
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t, taps=(2, 4, 5)), "layers 0..4", "[5]")


def test_refuses_d2t_out_of_range(target, tmp_path):
    tensors, d2t = head_tensors()
    d2t[-1] = TARGET["vocab_size"]
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t), "outside the trunk's vocabulary", "131")


def test_refuses_duplicated_d2t(target, tmp_path):
    tensors, d2t = head_tensors()
    d2t = d2t - torch.arange(d2t.numel())  # HF's offsets, not converted to absolute ids
    d2t[d2t < 0] = 0
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t), "twice", "offsets")


def test_refuses_another_vocabulary(target, tmp_path):
    tensors, d2t = head_tensors(own_embedding=True)
    tensors["token_embd.weight"] = tensors["token_embd.weight"][:120]
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t, vocab=False), "token_embd has 120 rows")


def test_refuses_another_tokenizer(target, tmp_path):
    tensors, d2t = head_tensors()
    vocab = byte_level_vocab(TARGET["vocab_size"])
    vocab["tokenizer.ggml.tokens"] = list(vocab["tokenizer.ggml.tokens"])
    vocab["tokenizer.ggml.tokens"][50] = "zz"
    from verispec_eagle3.gguf_writer import write_eagle3_gguf

    path = write_eagle3_gguf(tmp_path / "h.gguf", tensors, target_layers=(1, 2, 4), num_heads=4, num_kv_heads=2,
                             d2t=d2t, vocab=vocab)
    _mismatch(target, path, "another tokenizer", "at id 50")


def test_refuses_a_draft_vocabulary_without_d2t(target, tmp_path):
    tensors, _ = head_tensors()
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, None), "40 draft rows without a d2t")


def test_refuses_d2t_over_the_borrowed_lm_head(target, tmp_path):
    tensors, d2t = head_tensors(own_output=False)
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t), "borrows the trunk's LM head of 131 rows")


def test_refuses_a_borrowed_embedding_of_another_width(target, tmp_path):
    tensors, d2t = head_tensors(hidden=36)  # its own LM head, the trunk's 48-wide embedding
    _mismatch(target, write_head(tmp_path / "h.gguf", tensors, d2t), "36 wide and borrows the trunk's embedding")


def test_refuses_a_trunk_of_another_family(tmp_path):
    tensors, d2t = head_tensors()
    _, config = read_config(write_head(tmp_path / "h.gguf", tensors, d2t))
    problem = binding_problem(config, d2t, None, ToyTrunk(vocab_size=16))
    assert "llama/qwen2 trunks" in problem and "ToyTrunk" in problem


@pytest.mark.parametrize("change, error, needle", [
    ({"eagle3.target_layers": [1, 2]}, UnsupportedEagle3, "has 2 ids"),
    ({"eagle3.block_count": 2}, UnsupportedEagle3, "block_count is 2"),
])
def test_refuses_other_shapes_of_the_format(target, tmp_path, change, error, needle):
    tensors, d2t = head_tensors()
    with pytest.raises(error, match=needle):
        load(write_head(tmp_path / "h.gguf", tensors, d2t, extra_metadata=change), target[2])


def test_refuses_tensors_the_math_does_not_read(target, tmp_path):
    tensors, d2t = head_tensors()
    tensors["blk.0.attn_q.bias"] = torch.zeros(48)
    with pytest.raises(UnusedTensors, match="attn_q.bias"):
        load(write_head(tmp_path / "h.gguf", tensors, d2t), target[2])


def test_refuses_a_d2t_that_is_not_int64(target, tmp_path):
    tensors, d2t = head_tensors()
    tensors["d2t"] = d2t.float()
    with pytest.raises(UnsupportedEagle3, match="I64"):
        load(write_head(tmp_path / "h.gguf", tensors, None), target[2])


@pytest.mark.parametrize("values, counts", [([float("nan")], "1 NaN of"),
                                            ([float("inf"), float("-inf")], "2 inf of")])
def test_refuses_non_finite_weights_naming_the_tensor(target, tmp_path, values, counts):
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values

    tensors, d2t = head_tensors()
    good = write_head(tmp_path / "h.gguf", tensors, d2t)
    bad = plant_values(good, tmp_path / "bad.gguf", "fc.weight", values)
    with pytest.raises(DamagedFile) as info:
        load(bad, target[2])
    message = str(info.value)
    size = tensors["fc.weight"].numel()
    assert message.startswith(f"{bad}: tensor 'fc.weight' holds {counts} {size:,} values; ")
    assert "train it again" in message and "\n" not in message
