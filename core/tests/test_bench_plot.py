"""`verispec bench --plot` (verispec.bench.plot) and the per-step records it draws
(step_stats.StepRecord through Generation.step_records), on the toy GGUF with an echo drafter."""
import struct
import sys

import pytest

from verispec import api
from verispec.bench.run import compare, load_scenarios
from verispec.engine import SpecOptions
from verispec.step_stats import StepRecord
from verispec.reasons import PLAIN_CAUSES
from verispec.hookspecs import hookimpl
from verispec.registry import Registry
from verispec.specs import SpeculatorSpec
from verispec.testing import toy_plugin
from verispec.testing.toy import EchoSpeculator, write_toy_gguf

ECHO = SpecOptions(spec_type="echo", adaptive=False)


class EchoPlugin:
    @hookimpl
    def register_speculators(self, register):
        register(SpeculatorSpec(name="echo", summary="1-gram echo (test)", factory=lambda t, **kw: EchoSpeculator(
            kw["spec"], max_draft_tokens=kw["max_draft_tokens"]), priority=10))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_toy_gguf(tmp_path_factory.mktemp("toy") / "toy.gguf", vocab_size=110, recurrent=False, seed=3)
    return api.load(path, registry=Registry.from_plugins({"toy": toy_plugin, "echo": EchoPlugin()}), spec=ECHO,
                    context_length=4096)


@pytest.fixture(scope="module")
def measured(engine):
    """Two bench rows (a single prompt, a multi-turn one) and each one's speculative step trace."""
    scenarios = load_scenarios(["prose", "echo-own"])
    traces = {s["name"]: [] for s in scenarios}
    rows = [compare(engine, {**s, "max_new_tokens": 24}, ECHO, trace=traces[s["name"]]) for s in scenarios]
    for row, s in zip(rows, scenarios):
        row["turns"] = len(s.get("turns") or [s["prompt"]])
    return rows, traces


def test_step_records_add_up_to_the_rows_counts(measured):
    rows, traces = measured
    for row in rows:
        steps = traces[row["scenario"]]
        assert steps and all(isinstance(s, StepRecord) for s in steps)
        assert sum(s.num_emitted for s in steps) == row["new_tokens"] - row["turns"]  # a turn's first token: its prefill
        assert sum(s.num_drafted for s in steps) == row["drafted"]
        assert sum(s.num_accepted for s in steps) == row["accepted"]
        assert {s.kind for s in steps} <= {"spec", "no_draft", *PLAIN_CAUSES} and any(s.kind == "spec" for s in steps)
        assert all(s.num_accepted <= s.num_drafted for s in steps)
        # accepted drafts and the correction or bonus token; fewer when max_tokens ends the window
        assert all(1 <= s.num_emitted <= s.num_accepted + 1 if s.kind == "spec" else s.num_emitted == 1 for s in steps)
        assert "parked" not in {s.kind for s in steps}  # --spec-adaptive off: the governor never parks


def test_no_records_unless_asked_for(engine):
    generation = engine.generate("the cat sat", max_tokens=8, ignore_eos=True)
    list(generation)
    assert generation.result.spec.steps is None


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_plot_draws_both_panels_with_parked_steps_shaded(measured, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'matplotlib>=3.8' (./scripts/setup.sh installs it)")
    from verispec.bench.plot import plot_bench, trace_scenario

    rows, traces = measured
    name = trace_scenario(rows)
    assert name == max(rows, key=lambda r: r["accepted"])["scenario"]
    parked = [StepRecord("parked", 0, 0, 1)] * 5 + [StepRecord("measuring", 0, 0, 1)]
    steps = parked + traces[name] + parked  # two parks: two shaded spans, one legend entry
    fig = plot_bench(rows, name, steps, tmp_path / "bench.png")
    speeds, trace = fig.axes
    assert len(fig.axes) == 2
    assert [t.get_text() for t in speeds.get_xticklabels()] == [r["scenario"] for r in rows]
    assert len(speeds.patches) == 2 * len(rows)  # a plain and a speculative bar per scenario
    assert f"{name}: {len(steps)} steps" in trace.get_title()
    labels = trace.get_legend_handles_labels()[1]
    assert labels.count("governor parked") == 1 and {"drafted", "accepted", "tokens emitted"} <= set(labels)
    shaded = [p for p in trace.patches if p.get_label() == "governor parked" or p.get_facecolor()[:3] == pytest.approx(
        (0xfd / 255, 0xd0 / 255, 0xa2 / 255))]
    assert len(shaded) == 2
    assert _png_size(tmp_path / "bench.png") == (1100, 800)
    assert 20_000 < (tmp_path / "bench.png").stat().st_size < 2_000_000


def test_plot_without_matplotlib_names_the_pip_command(monkeypatch):
    from verispec.bench.plot import MatplotlibMissing, plot_bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(MatplotlibMissing, match=r"-m pip install 'matplotlib>=3.8'"):
        plot_bench([], "x", [], "never.png")
