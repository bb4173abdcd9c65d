"""A distribution's own C kernel through the public build helper: the toy plugin's short
convolution (`verispec/testing/toy_conv.c`) is built by `kernels.build.CLibrary`, equals its
PyTorch statement bitwise, and without a compiler falls back with one warning naming it."""
import pytest
import torch

from verispec import cache_digest
from verispec.testing.toy import CONV_WIDTH, LIBRARY, ToyTrunk, reference_short_conv, short_conv


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The toy library undecided, built into an empty cache."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(LIBRARY, "_loaded", False)
    yield
    LIBRARY.reset()


def test_the_toy_kernel_is_built_under_its_own_name_and_checked(fresh, tmp_path):
    path = LIBRARY.build()
    assert path.name.startswith("toy-") and path.parent == tmp_path / "kernels"
    assert cache_digest.intact(path, "toy C library")
    assert LIBRARY.load() is not None


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_the_kernel_equals_its_pytorch_statement_bitwise(fresh, rows):
    assert LIBRARY.load() is not None, "the toy kernel did not build"
    g = torch.Generator().manual_seed(rows)
    padded = torch.randn(rows + CONV_WIDTH - 1, 48, generator=g) * 3
    weight = torch.randn(CONV_WIDTH, 48, generator=g)
    got = short_conv(padded, weight)
    assert got.shape == (rows, 48)
    assert torch.equal(got, reference_short_conv(padded, weight))
    # and each row alone gives the same bits (batch invariance)
    for i in range(rows):
        assert torch.equal(short_conv(padded[i:i + CONV_WIDTH], weight)[0], got[i])


def _logits(seed=2):
    """The toy trunk's logits for every row of one prompt (its recurrent layer runs the conv)."""
    from verispec.seams import Segment

    model = ToyTrunk(vocab_size=40, dim=16, seed=seed)
    seq = model.new_sequence()
    return model.forward([Segment(seq, [3, 1, 4, 1, 5, 9, 2, 6], logits="all")])[0].logits


def test_without_a_compiler_one_warning_names_the_toy_and_its_output_is_unchanged(fresh, monkeypatch, tmp_path,
                                                                                   caplog):
    assert LIBRARY.load() is not None
    with_kernel = _logits()
    monkeypatch.setattr(LIBRARY, "_loaded", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "empty"))
    assert LIBRARY.load() is None
    assert LIBRARY.load() is None  # decided once
    said = [r.getMessage() for r in caplog.records if r.name == "verispec.kernels.build"]
    assert len(said) == 1 and "the toy kernels are unavailable" in said[0] and "PyTorch path" in said[0]
    assert torch.equal(_logits(), with_kernel)
