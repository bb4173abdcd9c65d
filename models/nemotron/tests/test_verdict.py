"""The speculation verdict, measured: teacher-forced, one prefix through a k-row verify
and through k one-row decodes, max |Δlogit| per row for k = 2..16.

int8 (the default dtype) must be bitwise (every op a row sees has its one-row shape), so the
family speculates like any other trunk and `speculation_refusal` stays None; fp32 (MKL gemm
changes its blocking with the row count) is held to the parity bound. README.md "Verdict"
records the table `verify_vs_decode` prints: python models/nemotron/tests/test_verdict.py
"""
import pytest
import torch
from verispec.seams import declared
from verispec.testing import forward_one, plain_logits
from verispec_nemotron.loader import load

pytest.importorskip("transformers")

KS = range(2, 17)
PREFIX_LEN = 20
FP32_BOUND = 1e-4


def verify_vs_decode(trunk, seed=3) -> list[list[float]]:
    """For each k in KS: max |Δlogit| of each of the k verify rows against the one-row decodes."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, trunk.vocab_size, (PREFIX_LEN,), generator=g).tolist()
    rows = torch.randint(0, trunk.vocab_size, (max(KS),), generator=g).tolist()
    decodes = plain_logits(trunk, prefix + rows)[PREFIX_LEN:]  # [16, V]
    table = []
    for k in KS:
        seq = trunk.new_sequence()
        forward_one(trunk, seq, prefix, logits="none")
        verify = forward_one(trunk, seq, rows[:k], verify=True).logits  # [k, V]
        trunk.release(seq)
        table.append((verify - decodes[:k]).abs().amax(dim=-1).tolist())
    return table


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_k_row_verify_against_one_row_decodes(tiny_fixture, name, dtype):
    _, path = tiny_fixture(name)
    trunk = load(path, dtype=dtype, use_cache=False, tokenizer=False)
    table = verify_vs_decode(trunk)
    worst = max(max(per_row) for per_row in table)
    if dtype == "int8":
        assert worst == 0.0, f"int8 verify rows differ from one-row decodes by up to {worst:.3g}"
        assert declared(trunk, "spec_batch_invariant")
    else:
        assert worst <= FP32_BOUND
    assert declared(trunk, "speculation_refusal") is None


def test_keep_selects_recorded_state_without_a_re_forward(tiny_fixture, monkeypatch):
    """After a verify, keep(a) for any a runs no forward: the Mamba-2 conv/SSM state after row a
    was recorded during the verify (nn.state.RecurrentState)."""
    _, path = tiny_fixture("moe")
    trunk = load(path, dtype="int8", use_cache=False, tokenizer=False)
    prefix, rows = [3, 14, 15, 92, 65, 35], [89, 79, 32, 38, 46]
    reference = plain_logits(trunk, prefix + rows)
    calls = []
    forward_rows = trunk._forward_rows
    monkeypatch.setattr(trunk, "_forward_rows", lambda r: calls.append(len(r.tokens)) or forward_rows(r))
    for kept in range(len(rows) + 1):
        seq = trunk.new_sequence()
        forward_one(trunk, seq, prefix, logits="none")
        forward_one(trunk, seq, rows, logits="none", verify=True)
        calls.clear()
        trunk.keep(seq, kept)
        assert calls == []
        assert trunk.seq_len(seq) == len(prefix) + kept
        if kept < len(rows):
            after = forward_one(trunk, seq, [rows[kept]]).logits[0]
            assert torch.equal(after, reference[len(prefix) + kept])
        trunk.release(seq)


def test_a_verify_split_across_forward_chunks_keeps_every_row_count(tiny_fixture):
    """A 12-row verify in 5-row forward chunks arrives at the Mamba-2 state in three pieces;
    keep(a) still selects the state after row a, bitwise (int8)."""
    _, path = tiny_fixture("dense")
    trunk = load(path, dtype="int8", use_cache=False, tokenizer=False, max_rows_per_forward=5)
    prefix = [2, 71, 82, 81, 82, 8, 45, 90]
    rows = [23, 53, 60, 28, 74, 71, 35, 26, 62, 49, 77, 57]
    reference = plain_logits(trunk, prefix + rows)
    for kept in range(len(rows)):
        seq = trunk.new_sequence()
        forward_one(trunk, seq, prefix, logits="none")
        verify = forward_one(trunk, seq, rows, verify=True).logits
        assert torch.equal(verify, reference[len(prefix):])
        trunk.keep(seq, kept)
        after = forward_one(trunk, seq, [rows[kept]]).logits[0]
        assert torch.equal(after, reference[len(prefix) + kept])
        trunk.release(seq)


if __name__ == "__main__":  # print the README table
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import tempfile

    from tiny_nemotron import build_hf_model, write_fixture

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("dense", "moe"):
            path = write_fixture(build_hf_model(name), Path(tmp) / f"{name}.gguf")
            for dtype in ("float32", "int8"):
                table = verify_vs_decode(load(path, dtype=dtype, use_cache=False, tokenizer=False))
                cells = [f"{max(per_row):.1e}" if max(per_row) else "0" for per_row in table]
                print(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
