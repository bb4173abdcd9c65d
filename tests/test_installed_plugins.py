"""Every installed verispec plugin loads cleanly through its entry point and declares valid specs."""
import pytest

from verispec.registry import Registry
from verispec.specs import resolve


@pytest.fixture(scope="module")
def registry():
    return Registry.discover()


def test_no_installed_plugin_is_broken(registry):
    assert [row for row in registry.plugin_rows() if row["kind"] == "error"] == []


def test_the_ngram_speculator_is_installed(registry):
    assert "ngram" in registry.speculators


def test_every_factory_and_loader_resolves(registry):
    rows = registry.plugin_rows()
    assert rows, "no plugin installed: install the distributions under plugins/ and models/"
    for entry in registry.speculators.values():
        assert callable(resolve(entry.spec.factory))
