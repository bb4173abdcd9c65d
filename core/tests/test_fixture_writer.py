"""verispec.testing.fixture_writer: key types, tensor layout and the byte-level vocabulary,
checked with gguf's own reader (gguf.GGUFReader) as the independent oracle."""
import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType, GGUFValueType

from verispec.testing.fixture_writer import SPECIAL_TOKENS, byte_level_vocab, bytes_to_unicode, write_gguf


def _reader_value(field):
    return field.contents()


def test_metadata_types_follow_llama_cpp(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", arch="gemma3", vocab=None,
                      tensors={"output_norm.weight": torch.ones(8)},
                      metadata={
                          "gemma3.block_count": 2,                      # count -> u32
                          "gemma3.attention.layer_norm_rms_epsilon": 1e-6,  # float -> f32
                          "gemma3.some_signed": -3,                      # negative -> i32
                          "gemma3.flag": True,                           # bool
                          "general.name": "tiny",                        # string
                          "gemma3.per_layer": [4, 8],                    # list of counts -> u32[]
                          "gemma3.pattern": np.array([True, False]),     # numpy keeps its dtype
                          "gemma3.big": gguf.GGUFValue(2**40, GGUFValueType.UINT64),  # pinned type
                      })
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert _reader_value(fields["general.architecture"]) == "gemma3"
    expect = {
        "gemma3.block_count": ([GGUFValueType.UINT32], 2),
        "gemma3.some_signed": ([GGUFValueType.INT32], -3),
        "gemma3.flag": ([GGUFValueType.BOOL], True),
        "general.name": ([GGUFValueType.STRING], "tiny"),
        "gemma3.per_layer": ([GGUFValueType.ARRAY, GGUFValueType.UINT32], [4, 8]),
        "gemma3.pattern": ([GGUFValueType.ARRAY, GGUFValueType.BOOL], [True, False]),
        "gemma3.big": ([GGUFValueType.UINT64], 2**40),
    }
    for key, (types, value) in expect.items():
        assert fields[key].types == types, key
        assert _reader_value(fields[key]) == value, key
    eps = fields["gemma3.attention.layer_norm_rms_epsilon"]
    assert eps.types == [GGUFValueType.FLOAT32] and _reader_value(eps) == pytest.approx(1e-6)


def test_tensors_are_written_in_llama_cpp_dim_order(tmp_path):
    weight = torch.randn(37, 64)  # nn.Linear(64, 37).weight: [out, in]
    path = write_gguf(tmp_path / "t.gguf", arch="llama", metadata={}, vocab=None,
                      tensors={"blk.0.attn_q.weight": weight, "blk.0.q8.weight": weight},
                      tensor_types={"blk.0.q8.weight": "Q8_0"})
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    f32 = tensors["blk.0.attn_q.weight"]
    assert list(f32.shape) == [64, 37]  # GGUF ne: fastest-moving dim first
    assert f32.tensor_type == GGMLQuantizationType.F32
    np.testing.assert_array_equal(np.asarray(f32.data).reshape(37, 64), weight.numpy())
    q8 = tensors["blk.0.q8.weight"]
    assert list(q8.shape) == [64, 37] and q8.tensor_type == GGMLQuantizationType.Q8_0


def test_tensor_types_must_name_written_tensors(tmp_path):
    with pytest.raises(ValueError, match="not written"):
        write_gguf(tmp_path / "x.gguf", arch="llama", metadata={}, vocab=None,
                   tensors={"a.weight": torch.zeros(2, 32)}, tensor_types={"b.weight": "Q8_0"})


def test_empty_metadata_array_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty array"):
        write_gguf(tmp_path / "x.gguf", arch="llama", metadata={"llama.list": []}, vocab=None, tensors={})


@pytest.mark.parametrize("vocab_size", [103, 131, 259, 260, 261, 300, 1000])
def test_byte_level_vocab_layout(vocab_size):
    vocab = byte_level_vocab(vocab_size)
    tokens, types = vocab["tokenizer.ggml.tokens"], vocab["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == vocab_size
    assert len(set(tokens)) == vocab_size
    assert tuple(tokens[:4]) == SPECIAL_TOKENS and list(types[:4]) == [3, 3, 3, 3]
    assert tokens[vocab["tokenizer.ggml.bos_token_id"]] == "<bos>"
    assert tokens[vocab["tokenizer.ggml.eos_token_id"]] == "<eos>"
    spell = bytes_to_unicode()
    byte_tokens = [t for t in tokens if t in set(spell.values())]
    assert len(byte_tokens) == min(256, vocab_size - 5)
    printable = {spell[b] for b in list(range(0x20, 0x7F)) + [0x0A, 0x09, 0x0D]}
    assert printable <= set(byte_tokens)  # kept first when the vocabulary is small
    merges = vocab["tokenizer.ggml.merges"]
    assert len(merges) >= 1  # llama.cpp refuses a gpt2 vocabulary without merges
    for merge in merges:  # every merge joins tokens that precede its result
        left, right = merge.split(" ")
        result = tokens.index(left + right)
        assert tokens.index(left) < result and tokens.index(right) < result
    padding = [t for t in tokens if t.startswith("<unused")]
    assert all(types[tokens.index(t)] == 3 for t in padding)
    if vocab_size >= 4 + 256 + 32:
        assert len(merges) == 32 and len(padding) == vocab_size - 292


def test_byte_level_vocab_refuses_too_small():
    with pytest.raises(ValueError, match="vocab_size >= 103"):
        byte_level_vocab(102)


def test_bytes_to_unicode_is_gpt2_table():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


def test_byte_level_vocab_size_comes_from_the_embedding(tmp_path):
    path = write_gguf(tmp_path / "v.gguf", arch="llama", metadata={},
                      tensors={"token_embd.weight": torch.zeros(131, 32)})
    fields = gguf.GGUFReader(path).fields
    assert len(fields["tokenizer.ggml.tokens"].data) == 131
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert fields["tokenizer.ggml.bos_token_id"].types == [GGUFValueType.UINT32]
    with pytest.raises(ValueError, match="vocab_size"):
        write_gguf(tmp_path / "w.gguf", arch="llama", metadata={}, tensors={})
