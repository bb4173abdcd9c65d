"""The maps of core's modules stay true: docs/design.md's "Core's module map" lists exactly what
`ls core/src/verispec` shows, what it marks [no torch] imports without torch, and every package's
`__init__.py` docstring names each of its modules."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import verispec

ROOT = Path(verispec.__file__).parent
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _design_map() -> dict[str, str]:
    """name -> its lines in the map (continuation lines included)."""
    if not DESIGN.is_file():
        pytest.skip("docs/design.md is not beside this checkout's core/")
    text = DESIGN.read_text()
    block = re.search(r"### Core's module map\n.*?```\nsrc/verispec/\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no module map under \"### Core's module map\""
    entries: dict[str, str] = {}
    name = None
    for line in block.group(1).splitlines():
        head = re.match(r"  (\S+)\s{2,}", line)
        if head:
            name = head.group(1)
            assert name not in entries, f"{name} is listed twice"
            entries[name] = line
        else:
            entries[name] += "\n" + line
    return entries


def _listing() -> set[str]:
    return {p.name + ("/" if p.is_dir() else "") for p in ROOT.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}


def test_design_map_matches_the_folder():
    listed, present = set(_design_map()), _listing()
    assert not present - listed, f"in core/src/verispec but not in docs/design.md's map: {sorted(present - listed)}"
    assert not listed - present, f"in docs/design.md's map but not in core/src/verispec: {sorted(listed - present)}"


def test_modules_marked_no_torch_import_without_it():
    names = [name for name, lines in _design_map().items() if "[no torch]" in lines]
    modules = ["verispec" if n == "__init__.py" else "verispec." + n.removesuffix(".py").rstrip("/") for n in names]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"one of {modules} imports torch"


def _documented(doc: str, module: str) -> bool:
    if re.search(rf"`{re.escape(module)}[`.(]", doc):
        return True
    return any(module.startswith(prefix) for prefix in re.findall(r"`(\w+_)\*`", doc))


@pytest.mark.parametrize("package", sorted(p.parent.name for p in ROOT.glob("*/__init__.py")))
def test_each_package_maps_its_modules(package):
    folder = ROOT / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = [p.stem for p in sorted(folder.glob("*.py")) if p.stem != "__init__" and not _documented(doc, p.stem)]
    assert not missing, f"verispec/{package}/__init__.py's docstring does not name {missing}"
