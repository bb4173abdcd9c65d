"""benchmarks/verify_cost.py: the verify/keep cost table runs on attention and recurrent trunks,
leaves the sequence as it found it, and derives the draft window from the formula it states."""
import sys
from pathlib import Path

import pytest

from verispec.testing.toy import ToyTrunk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
verify_cost = pytest.importorskip("verify_cost", reason="benchmarks/verify_cost.py not found")  # our script


def test_tokens_per_verify_is_the_expected_accepted_prefix_plus_one():
    # a = 0.5, K = 2: P(0 accepted) 0.5 -> 1 token, P(1) 0.25 -> 2, P(2) 0.25 -> 3: 1.75
    assert verify_cost.tokens_per_verify(0.5, 2) == pytest.approx(1.75)
    assert verify_cost.tokens_per_verify(0.9, 0) == pytest.approx(1.0)


@pytest.mark.parametrize("recurrent", [False, True])
def test_measure_times_every_width_on_attention_and_recurrent_state(recurrent, monkeypatch):
    monkeypatch.setattr(verify_cost, "wait_quiet", lambda limit_s=10.0: True)
    trunk = ToyTrunk(64, 8, recurrent=recurrent, seed=0, max_context_length=256)
    one_row, table = verify_cost.measure(trunk, [1, 2, 4], ctx=12, reps=2)
    assert one_row > 0 and sorted(table) == [1, 2, 4]
    assert all(t[name] > 0 for t in table.values() for name in ("verify", "keep", "reforward"))
