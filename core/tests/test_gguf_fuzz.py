"""Fuzzing the GGUF header parser (verispec.gguf.io) from a valid fixture written by
verispec.testing.fixture_writer: truncations, byte mutations and huge count fields never
crash with a foreign exception, never hang, and never allocate more than a small multiple of
the file's size (a count claiming 2**60 entries is refused before anything is allocated for
it); every refusal is the project's own GGUFError (a verispec.errors.VerispecError)."""
import os
import struct
import tracemalloc
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.errors import VerispecError
from verispec.gguf.io import GGUFError, GGUFFile, read_architecture
from verispec.testing.fixture_writer import write_gguf

#: Python objects cost more than their bytes in the file (a 2-byte token is a ~50-byte str), so
#: "no more than the file" means: within this factor of its size, plus a fixed allowance.
MEMORY_FACTOR, MEMORY_SLACK = 8, 64 << 10
#: fields an attacker would set: lengths and counts near 2**60 and 2**64, a u32 at its top.
HUGE = [2**60, 2**64 - 1, 2**63, 2**32 - 1, 2**32]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """(the bytes of a valid GGUF with every value kind and three tensor types, its data offset)."""
    g = torch.Generator().manual_seed(0)
    path = write_gguf(tmp_path_factory.mktemp("fuzz") / "valid.gguf", arch="llama",
                      metadata={"llama.block_count": 1, "llama.rope.freq_base": 10000.0, "llama.flag": True,
                                "general.name": "fuzz ü", "general.tags": ["a", "bc"],
                                "llama.ffl": np.array([3, 4], dtype=np.uint32), "llama.nested": [[1, 2], [3]]},
                      tensors={"token_embd.weight": torch.randn(110, 32, generator=g),
                               "blk.0.attn_norm.weight": torch.randn(32, generator=g),
                               "output.weight": torch.randn(16, 32, generator=g)},
                      tensor_types={"token_embd.weight": "Q8_0", "output.weight": "F16"})
    data = open(path, "rb").read()
    return data, GGUFFile.open(path).data_offset


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """probe(data): open `data` as a GGUF (and, with architecture=True, read_architecture it);
    returns the error GGUFFile.open raised (a GGUFError) or None. Fails on any other exception
    and on allocations beyond the memory bound."""
    directory = tmp_path_factory.mktemp("probe")
    path = directory / "probe.gguf"
    tracemalloc.start()

    def run(data: bytes, architecture: bool = True):
        path.unlink(missing_ok=True)  # a new inode: an older GGUFFile's map never sees a shorter file
        path.write_bytes(data)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        error = None
        try:
            f = GGUFFile.open(path)
        except GGUFError as e:
            assert isinstance(e, VerispecError) and str(e)
            error = e
        else:
            for name in f:  # every tensor it accepts lies in the file and can be viewed
                info = f.tensor_info(name)
                assert f.data_offset <= info.offset and info.offset + info.nbytes <= len(data)
                f.raw_tensor(name)
            f.metadata_digest()
            del f
        peak = tracemalloc.get_traced_memory()[1] - before
        assert peak <= MEMORY_FACTOR * len(data) + MEMORY_SLACK, f"{peak} bytes allocated for a {len(data)}-byte file"
        if architecture:
            try:
                assert isinstance(read_architecture(path), str)
            except GGUFError:
                pass
        return error

    yield run
    tracemalloc.stop()


def test_the_fixture_opens(fixture, probe):
    data, _ = fixture
    assert probe(data) is None


def test_every_truncation_is_refused_as_truncated_or_corrupt(fixture, probe):
    data, data_offset = fixture
    sizes = [*range(data_offset + 1), *range(data_offset + 1, len(data), 97), len(data) - 1]
    for size in sizes:  # every cut inside the header, a sample of cuts into the tensor data
        error = probe(data[:size])
        assert error is not None, f"a file cut to {size} of {len(data)} bytes opened"


def test_a_huge_count_anywhere_in_the_header_is_refused_before_it_allocates(fixture, probe):
    """Every header offset overwritten with 2**60 and 2**64 - 1 as u64 and 2**32 - 1 as u32:
    string lengths, array counts, tensor and key counts, dims, n_dims, types, offsets."""
    data, data_offset = fixture
    refused = 0
    for pos in range(4, data_offset):
        for fmt, value in (("<Q", 2**60), ("<Q", 2**64 - 1), ("<I", 2**32 - 1)):
            if pos + struct.calcsize(fmt) <= len(data):
                patched = bytearray(data)
                struct.pack_into(fmt, patched, pos, value)
                refused += probe(bytes(patched), architecture=pos < 64) is not None
    assert refused > data_offset  # most positions hold a length, count, type or offset


@settings(max_examples=200, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_mutations_and_truncations(fixture, probe, data):
    original, data_offset = fixture
    blob = bytearray(original)
    for _ in range(data.draw(st.integers(1, 8), label="mutations")):
        # mostly the header (where the parser reads), sometimes anywhere
        end = data.draw(st.sampled_from([data_offset, len(blob)]), label="region")
        pos = data.draw(st.integers(0, end - 1), label="position")
        kind = data.draw(st.sampled_from(["byte", "u32", "u64", "delete", "insert"]), label="kind")
        if kind == "byte":
            blob[pos] = data.draw(st.integers(0, 255), label="byte")
        elif kind in ("u32", "u64"):
            width = 4 if kind == "u32" else 8
            value = data.draw(st.one_of(st.sampled_from([0, 1, 7, 8, 255, *HUGE]), st.integers(0, 2**(8 * width) - 1)),
                              label="value")
            blob[pos:pos + width] = (value % 2**(8 * width)).to_bytes(width, "little")
        elif kind == "delete":
            del blob[pos:pos + data.draw(st.integers(1, 16), label="deleted")]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16), label="inserted")
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[:data.draw(st.integers(0, len(blob)), label="size")]
    probe(bytes(blob))


def test_deeply_nested_arrays_are_corrupt_not_a_recursion_error(tmp_path, probe):
    depth = 5000  # past Python's recursion limit
    key = b"general.deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body
    error = probe(data)
    assert error is not None and "nests arrays deeper" in str(error)


def test_an_alignment_that_is_not_an_integer_is_corrupt(tmp_path, probe):
    for value, vtype in ((b"\x05\x00\x00\x00\x00\x00\x00\x00abcde", 8), (struct.pack("<f", 32.0), 6)):
        key = b"general.alignment"
        data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value
        assert "general.alignment is a" in str(probe(data))
