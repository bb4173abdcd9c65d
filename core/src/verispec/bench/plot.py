"""`verispec bench --plot FILE.png`: the bench rows and one scenario's per-step trace, in two panels.

Top: plain vs speculative decode tok/s per scenario, each speculative bar annotated with its
acceptance (accepted / drafted) and speedup. Bottom: the speculative run of one scenario step by
step (step_stats.StepRecord): tokens emitted per step, drafted vs accepted per step, and the
steps the cost governor parked shaded. It is the picture of where drafting paid.

matplotlib is core's optional `plot` extra (`pip install 'matplotlib>=3.8'`); it is imported only here,
through its object API (no pyplot, no global backend).
"""
from __future__ import annotations

from collections.abc import Sequence

from verispec.errors import VerispecError, pip_install


class MatplotlibMissing(VerispecError, ImportError):
    """--plot without matplotlib: the message is the pip command that installs it."""

    def __init__(self):
        super().__init__(f"--plot needs matplotlib: {pip_install(repr('matplotlib>=3.8'))} (core's plot extra; "
                         "./scripts/setup.sh installs it)")


def require_matplotlib() -> None:
    """Raise MatplotlibMissing unless matplotlib imports (checked before a model loads)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MatplotlibMissing() from None


def trace_scenario(rows: Sequence[dict]) -> str:
    """The scenario whose trace is drawn: the one with the most accepted tokens (the first on a tie)."""
    return max(rows, key=lambda r: r["accepted"])["scenario"]


def plot_bench(rows: Sequence[dict], scenario: str, steps: Sequence, path) -> "matplotlib.figure.Figure":  # noqa: F821
    """Draw `rows` (bench.compare's dicts) and the step trace of `scenario` (its StepRecords,
    in order) into a PNG at `path` (a str or PathLike); returns the Figure (two axes).

    Raises MatplotlibMissing without matplotlib."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), dpi=100, layout="constrained")
    speeds, trace = fig.subplots(2, 1, height_ratios=(1, 1.2))
    _speeds(speeds, rows)
    _trace(trace, scenario, steps)
    fig.savefig(path, format="png")
    return fig


def _speeds(ax, rows: Sequence[dict]) -> None:
    names = [r["scenario"] for r in rows]
    x = range(len(rows))
    width = 0.38
    ax.bar([i - width / 2 for i in x], [r["plain_decode_tps"] for r in rows], width, label="plain", color="#9e9e9e")
    bars = ax.bar([i + width / 2 for i in x], [r["spec_decode_tps"] for r in rows], width, label="speculative",
                  color="#1f77b4")
    for bar, r in zip(bars, rows):
        acceptance = f"{100 * r['accepted'] / r['drafted']:.0f}% of {r['drafted']}" if r["drafted"] else "no drafts"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        ax.annotate(f"{speedup}\n{acceptance}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("plain vs speculative decoding (speedup, acceptance = accepted / drafted)")
    ax.margins(y=0.25)
    ax.legend(loc="upper left", fontsize=8)


def _trace(ax, scenario: str, steps: Sequence) -> None:
    from matplotlib.ticker import MaxNLocator

    x = range(len(steps))
    ax.bar(x, [s.num_drafted for s in steps], 0.9, color="#c6dbef", label="drafted")
    ax.bar(x, [s.num_accepted for s in steps], 0.9, color="#2171b5", label="accepted")
    ax.plot(x, [s.num_emitted for s in steps], color="black", marker=".", markersize=3, linewidth=0.8,
            label="tokens emitted")
    for n, (first, last) in enumerate(_runs([s.kind == "parked" for s in steps])):
        ax.axvspan(first - 0.5, last + 0.5, color="#fdd0a2", alpha=0.6, linewidth=0, zorder=0,
                   label=None if n else "governor parked")
    drafted = sum(s.num_drafted for s in steps)
    accepted = sum(s.num_accepted for s in steps)
    emitted = sum(s.num_emitted for s in steps)
    ax.set_title(f"{scenario}: {len(steps)} steps, {emitted} tokens, {accepted} of {drafted} drafts accepted")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens")
    ax.set_xlim(-0.5, max(len(steps), 1) - 0.5)
    ax.set_ylim(0, 1.35 * max([s.num_drafted for s in steps] + [s.num_emitted for s in steps] + [1]))  # room for the legend
    ax.legend(loc="upper right", fontsize=8)


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """(first, last) index of each run of True in `flags`."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs
