"""`assert_plugin_loads`: a plugin's hook module registers, and every reference it names imports
(`verispec plugins` and `verispec plugins --check`, in one test of the plugin's own suite)."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from verispec.cli.plugin_listing import format_check
from verispec.registry import Registry


def assert_plugin_loads(module: ModuleType | str | Any) -> Registry:
    """Register `module` (your hook module, or its import name) alone, as discovery would, then
    import every factory, decline check and loader it names. Fails naming each problem (a hook
    that raises, a wrong spec type, a typo'd "module:attr"); returns the Registry it built.

        def test_the_plugin_loads():
            registry = assert_plugin_loads("line_copy.hooks")
            assert "line-copy" in registry.speculators
    """
    plugin = importlib.import_module(module) if isinstance(module, str) else module
    name = getattr(plugin, "__name__", None) or type(plugin).__name__
    registry = Registry.from_plugins({name: plugin})
    rows = registry.check_references()
    problems = [row for row in rows if row["error"]]
    assert not problems, format_check(rows)
    assert any(registry.plugin_rows()), f"{name} registers nothing: implement a hook (verispec.hookspecs) that " \
                                        "calls register(...)"
    return registry
