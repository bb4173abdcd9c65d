"""No import cycles between verispec's modules (lazy imports inside functions included), and the
loop module knows no family or state kind: data flows engine → execution → trunk/speculator."""
import ast
from pathlib import Path

import verispec

ROOT = Path(verispec.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """verispec modules `path` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found - {_module_name(path)}


def _graph() -> dict[str, set[str]]:
    paths = list(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) - {"verispec"} for p in paths}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_loop_knows_no_family_or_state_kind():
    source = (ROOT / "execution.py").read_text()
    assert not _graph()["verispec.execution"] & {"verispec.nn", "verispec.nn.state", "verispec.nn.trunk",
                                                  "verispec.nn.trunk_module", "verispec.engine", "verispec.registry"}
    for word in ("RingKVCache", "RecurrentState", "PagedKVCache", "SequenceState", "gemma", "llama", "rewind",
                 "snapshot", "spec_has_recurrent_state"):
        assert word not in source, f"execution.py mentions {word!r}"
