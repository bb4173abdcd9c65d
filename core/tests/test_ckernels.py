"""The C kernels (kernels.ckernels): each bitwise its PyTorch statement, within fp32
rounding of the PyTorch attention path, and each row's bits independent of the call around it."""
import ctypes
import sys
from pathlib import Path

import pytest
import torch

from verispec import cache_digest
from verispec.kernels import build, ckernels
from verispec.nn.attention import attend, attend_rows
from verispec.nn.kv_cache import PagedKVCache, RingKVCache
from verispec.nn.state import SequenceState
from verispec.nn.trunk import Rows, RowsOfSequence


@pytest.fixture(autouse=True)
def kernel():
    if ckernels.library() is None:
        pytest.skip("no C compiler: the C kernels are not built")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _filled(ring: bool, Hkv: int, Dh: int, length: int, window: int, seed: int, key_block: int = 16):
    """A cache holding `length` random positions, written in 5-row chunks (a ring wraps)."""
    if ring:
        cache = RingKVCache(Hkv, Dh, window=window, max_rows=5, key_block=8)
    else:
        cache = PagedKVCache(Hkv, Dh, key_block=key_block, max_positions=256)
    state = SequenceState([cache])
    for p in range(0, length, 5):
        n = min(5, length - p)
        state.begin(n, verify=False)
        cache.write(p, torch.randn(n, Hkv, Dh, generator=_gen(seed + p)),
                    torch.randn(n, Hkv, Dh, generator=_gen(seed + 1000 + p)))
        state.seq_len += n
    return state


def _attend_alone(q, state, start, window):
    """attend_rows over already written K/V (k = None) for one sequence's rows."""
    rows = Rows(torch.zeros(len(q), dtype=torch.long), torch.zeros(len(q), dtype=torch.long),
                (RowsOfSequence(state, start, 0, len(q)),))
    return attend_rows(q, None, None, rows, 0, scaling=0.3, sliding_window=window)


@pytest.mark.parametrize("ring", [False, True], ids=["paged", "ring"])
@pytest.mark.parametrize("H, Hkv, Dh", [(4, 2, 8), (9, 3, 64), (7, 1, 24), (4, 1, 256)])
def test_the_kernel_is_bitwise_its_pytorch_statement_and_close_to_the_pytorch_path(ring, H, Hkv, Dh):
    window = 11 if ring else None
    length, n = 53, 6  # paged: 4 blocks of 16; ring: 15 slots, wrapped several times
    state = _filled(ring, Hkv, Dh, length, window or 0, seed=Dh)
    start = length - n
    q = torch.randn(n, H, Dh, generator=_gen(7))
    out = _attend_alone(q, state, start, window)
    cache = state.layers[0]
    k, v, slot_pos = cache.read(cache.key_length(length - 1))
    expected = ckernels.reference_attend(q, k.transpose(1, 2), v, slot_pos, torch.arange(start, length),
                                                 scaling=0.3, window=window)
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, attend(q, cache, start, scaling=0.3, sliding_window=window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("H, Hkv, Dh", [(4, 1, 256), (7, 1, 64), (9, 3, 64), (14, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("window", [None, 70])
def test_a_prefill_chunk_over_64_slot_blocks_is_bitwise_its_pytorch_statement(H, Hkv, Dh, window):
    """The kernel's 64-slot loops, with up to 4 query heads sharing each K and V load (heads in
    runs of 4, 3, 2, 1; Dh 48: no run of 64 columns, so values one head at a time), over the
    causal rows of a 20-row chunk at 120..139 (units of 8 rows, each row its own key length)."""
    length, n = 140, 20
    state = _filled(False, Hkv, Dh, length, 0, seed=H + Dh, key_block=64)
    q = torch.randn(n, H, Dh, generator=_gen(3))
    out = _attend_alone(q, state, length - n, window)
    cache = state.layers[0]
    k, v, slot_pos = cache.read(cache.key_length(length - 1))
    expected = ckernels.reference_attend(q, k.transpose(1, 2), v, slot_pos, torch.arange(length - n, length),
                                         scaling=0.3, window=window)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("ring", [False, True], ids=["paged", "ring"])
def test_a_verify_row_is_bitwise_the_row_decoded_alone_at_one_or_two_threads(ring, monkeypatch):
    window = 9 if ring else None
    state = _filled(ring, 2, 32, 40, window or 0, seed=1)
    q = torch.randn(5, 6, 32, generator=_gen(2))
    verify = _attend_alone(q, state, 35, window)
    for i in range(5):
        assert torch.equal(_attend_alone(q[i:i + 1], state, 35 + i, window)[0], verify[i])
    if not ring:  # 11 rows: the kernel takes rows in units of 8 that share each block read
        q11 = torch.randn(11, 6, 32, generator=_gen(3))
        wide = _attend_alone(q11, state, 29, window)
        for i in range(11):
            assert torch.equal(_attend_alone(q11[i:i + 1], state, 29 + i, window)[0], wide[i])
    monkeypatch.setattr(ckernels, "PARALLEL_WORK", 0)  # every call splits its rows over threads
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(_attend_alone(q, state, 35, window), verify)
    finally:
        torch.set_num_threads(before)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(ckernels.LIBRARY, "_loaded", False)
    monkeypatch.setenv("VERISPEC_C_KERNELS", "0")
    assert ckernels.library() is None


def test_a_failed_build_warns_once_and_the_pytorch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(ckernels.LIBRARY, "_loaded", False)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "cc -O0")  # a command line, as make takes it
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: type("R", (), {
        "returncode": 1, "stderr": "cc: error: unrecognized command-line option '-march=native'"})())
    assert ckernels.library() is None
    assert ckernels.library() is None  # decided once: one warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "verispec.kernels.build"]
    assert len(warnings) == 1
    assert "cc -O0 failed on kernels.c + qmatmul.c + layers.c: cc: error: unrecognized command-line option" in warnings[0]
    assert "PyTorch path" in warnings[0]
    state = _filled(False, 1, 8, 10, 0, seed=3)
    q = torch.randn(1, 2, 8, generator=_gen(4))
    assert torch.equal(_attend_alone(q, state, 9, None), attend(q, state.layers[0], 9, scaling=0.3))


def test_a_missing_compiler_names_cc(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match=r"\$CC=.*no-such-compiler' is not a program"):
        ckernels.LIBRARY.build()


@pytest.mark.parametrize("damage", ["cut short", "another file"])
def test_a_damaged_library_is_rebuilt_never_loaded(monkeypatch, tmp_path, damage):
    # a cut-short library can crash the process inside dlopen: it must be rebuilt, never loaded
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    path = ckernels.LIBRARY.build()
    good = path.read_bytes()
    path.write_bytes(good[:5000] if damage == "cut short" else Path(sys.executable).read_bytes())
    damaged = path.read_bytes()
    assert ckernels.LIBRARY.build() == path
    assert path.read_bytes() != damaged and cache_digest.intact(path, "C kernel library")
    assert ctypes.CDLL(str(path)).verispec_attend is not None


@pytest.mark.parametrize("ring", [False, True], ids=["paged", "ring"])
def test_the_kernel_writes_the_rows_where_the_cache_would(ring):
    window = 9 if ring else 0
    by_kernel, by_cache = (_filled(ring, 2, 8, 30, window, seed=5) for _ in range(2))
    if not ring:  # a shared block must be copied before the kernel writes into it
        shared = by_kernel.fork(30)
    k, v, q = (torch.randn(4, h, 8, generator=_gen(i)) for i, h in ((6, 2), (7, 2), (8, 4)))
    for state in (by_kernel, by_cache):
        state.begin(4, verify=False)
    rows = Rows(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                (RowsOfSequence(by_kernel, 30, 0, 4),))
    attend_rows(q, k, v, rows, 0, scaling=0.3, sliding_window=window or None)
    by_cache.layers[0].write(30, k, v)
    ours, theirs = by_kernel.layers[0], by_cache.layers[0]
    for a, b in zip(ours.read(ours.key_length(33)), theirs.read(theirs.key_length(33))):
        assert torch.equal(a, b)
    if not ring:
        assert torch.equal(shared.layers[0].read(32)[0][:, 30:], torch.zeros(2, 2, 8))  # untouched


@pytest.mark.parametrize("dim", [8, 37, 64, 576, 640])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_is_bitwise_its_pytorch_statement_and_close_to_torch(dim, with_weight):
    x = torch.randn(7, dim, generator=_gen(dim)) * 3
    weight = torch.randn(dim, generator=_gen(1)) if with_weight else None
    out = ckernels.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, ckernels.reference_rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (dim,), weight, 1e-6), atol=1e-5, rtol=1e-6)
    for i in range(7):  # a row alone is bitwise the row among others
        assert torch.equal(ckernels.rms_norm(x[i:i + 1].contiguous(), weight, 1e-6), out[i:i + 1])


def test_rmsnorm_module_runs_the_kernel_on_any_leading_shape():
    from verispec.nn.norm import RMSNorm

    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16, generator=_gen(2))
    x = torch.randn(3, 4, 16, generator=_gen(3)).transpose(0, 1)  # non-contiguous [4, 3, 16]
    expected = ckernels.reference_rms_norm(x.reshape(-1, 16), norm.weight, 1e-5).view(4, 3, 16)
    assert torch.equal(norm(x), expected)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("n, width", [(1, 1536), (5, 37), (3, 2048)])
def test_the_glu_kernels_are_their_pytorch_statement_and_close_to_torch(activation, n, width):
    """act(gate) · up: bitwise `reference_glu` (any width: 16-lane tails), within 1e-6 relative of
    torch's own silu / gelu(approximate="tanh") (the reference activations of transformers)."""
    gate_up = torch.randn(n, 2 * width, generator=_gen(n)) * 4
    gate_up[0, :5] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-4])
    ours = ckernels.glu(activation, gate_up.contiguous(), width)
    assert torch.equal(ours, ckernels.reference_glu(activation, gate_up, width))
    gate, up = gate_up[:, :width], gate_up[:, width:]
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    expected = act * up
    assert ((ours - expected).abs() <= 1e-6 * (gate.abs() * up.abs() + 1e-30)).all()
    rows = torch.cat([ckernels.glu(activation, gate_up[i:i + 1].contiguous(), width) for i in range(n)])
    assert torch.equal(ours, rows)  # a row's bits are its own
