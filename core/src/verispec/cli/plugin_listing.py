"""`verispec plugins`'s text: the aligned table of `Registry.plugin_rows()` and the report of
`Registry.check_references()` (`--check`). `--json` prints the rows themselves; these are the
human forms, also the failure message of `verispec.testing.assert_plugin_loads`. No torch.
"""
from __future__ import annotations

from verispec.install_hints import install_hint
from verispec.registry import ROW_KEYS, origin_text


def format_plugin_table(rows: list[dict]) -> str:
    """The human listing of `plugin_rows()`: one aligned line per row, declarations after the summary."""
    if not rows:
        return f"no verispec plugins are installed; e.g. {install_hint('plugins/ngram', 'models/gemma4')}"
    table = [("DISTRIBUTION", "VERSION", "PLUGIN", "KIND", "NAME", "DETAILS")]
    for row in rows:
        if row["kind"] == "error":
            details = "ERROR " + " ".join(row["error"].split())  # pluggy's messages span lines
        else:
            declarations = ", ".join(f"{k}={_show(v)}" for k, v in row.items() if k not in ROW_KEYS)
            details = f"{row['summary']} ({declarations})"
        table.append((row["distribution"] or "-", row["version"] or "-", row["plugin"], row["kind"],
                      row["name"] or "-", details))
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    lines = ("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[5]]) for line in table)
    return "\n".join(lines)


def format_check(rows: list[dict]) -> str:
    """The human report of `check_references()`: one line per problem, naming the distribution,
    then how many references were checked."""
    problems = [row for row in rows if row["error"]]
    lines = []
    for row in problems:
        where = origin_text((row["plugin"], row["distribution"], row["version"]))
        what = (f"{row['kind']} {row['name']!r}: {row['field']} {row['reference']!r} does not import: "
                if row["reference"] else "kept out: ")
        lines.append(f"{where}: {what}{' '.join(row['error'].split())}")
    checked = sum(1 for row in rows if row["reference"])
    verdict = f"{len(problems)} problem{'s' * (len(problems) != 1)}" if problems else "all import"
    lines.append(f"checked {checked} reference{'s' * (checked != 1)} of {len({r['plugin'] for r in rows})} "
                 f"plugin{'s' * (len({r['plugin'] for r in rows}) != 1)}: {verdict}")
    return "\n".join(lines)


def _show(value) -> str:
    return (",".join(value) or "-") if isinstance(value, list) else str(value)
