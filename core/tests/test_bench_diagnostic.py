"""`verispec bench --diagnostic` (verispec.bench.diagnostic) on the toy trunks: 0 everywhere on a
batch-invariant trunk, a rollback bug shows in the kept-prefix rows, and arithmetic noise in
multi-row forwards gives bounded errors whose flips all lie inside twice their row's error."""
import torch
import pytest

from verispec import api
from verispec.bench.diagnostic import DECODE, KEPT, VERIFY, format_diagnostic, run_diagnostic
from verispec.nn.state import RecurrentState
from verispec.registry import Registry
from verispec.testing import toy_plugin
from verispec.testing.toy import write_toy_gguf

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
K = 4


@pytest.fixture(scope="module", params=[False, True], ids=["attention", "recurrent"])
def engine(request, tmp_path_factory):
    path = write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=request.param,
                          seed=3)
    return api.load(path, registry=Registry.from_plugins({"toy": toy_plugin}), context_length=512)


def diagnose(engine, num_tokens=48):
    return run_diagnostic(engine, {"cat": engine.encode(PROMPT)}, num_tokens=num_tokens, max_draft_tokens=K)


def test_batch_invariant_trunk_shows_zero_error_in_every_row_class(engine):
    report = diagnose(engine)
    assert report.batch_invariant
    assert set(report.classes) == {*(VERIFY.format(i) for i in range(K + 1)), KEPT, DECODE}
    assert all(c.max_abs_error == 0 and c.num_flips == 0 for c in report.classes.values())
    assert report.flips == [] and report.ok
    # every stream token after the first is drawn by exactly one non-verify row or one verify row per window
    assert sum(c.num_rows for c in report.classes.values()) > report.num_tokens
    assert "batch-invariant: every error is 0; 0 flip(s)" in format_diagnostic(report)


def test_a_rollback_that_leaves_the_recurrent_state_of_the_whole_window_shows_in_kept_prefix_rows(
        engine, monkeypatch):
    if not engine.trunk.recurrent:
        pytest.skip("attention-only: no recurrent state to roll back")
    keep = RecurrentState.keep

    def stale_keep(self, length):  # the bug: keep every verify row's state, whatever was rejected
        num_rows = sum(len(chunk) for chunk in next(iter(self._rows.values())))
        keep(self, self._verify_base + num_rows)
    monkeypatch.setattr(RecurrentState, "keep", stale_keep)
    report = diagnose(engine)
    assert report.classes[KEPT].max_abs_error > 0
    assert not report.ok
    assert "a state bug, not arithmetic" in format_diagnostic(report)


def test_arithmetic_noise_in_multi_row_forwards_is_bounded_and_its_flips_lie_within_twice_the_error(
        engine, monkeypatch):
    trunk = engine.trunk
    forward = trunk.forward
    generator = torch.Generator().manual_seed(0)
    noise = 4.0  # logits of the toy reach ~30; margins of a few units flip

    def noisy(batch):  # a kernel whose multi-row results round differently from its one-row ones
        outs = forward(batch)
        for segment, out in zip(batch, outs):
            if out.logits is not None and len(segment.tokens) > 1:
                out.logits.add_((torch.rand(out.logits.shape, generator=generator) - 0.5) * noise)
        return outs
    monkeypatch.setattr(trunk, "forward", noisy)
    monkeypatch.setattr(trunk, "spec_batch_invariant", False, raising=False)
    report = diagnose(engine, num_tokens=96)
    verify = [report.classes[VERIFY.format(i)] for i in range(K + 1)]
    assert all(0 < c.max_abs_error <= noise / 2 for c in verify)
    assert report.flips, "the noise should flip some rows; raise it"
    assert all(f.row.startswith("verify row") and f.margin <= 2 * f.row_error for f in report.flips)
    assert report.ok
    assert "every one within twice its row's error" in format_diagnostic(report)
