"""Install hints name only what exists: this repository's distributions by their path (none is
on PyPI), PyPI packages by their real names."""
import re
from pathlib import Path

import pytest

from verispec.install_hints import DEFAULT_CHECKPOINT_INSTALL, install_hint
from verispec.cli.plugin_listing import format_plugin_table
from verispec.registry import Registry
from verispec.speculator_choice import choose_speculator

ROOT = Path(__file__).resolve().parents[1]


def _hint_files():
    for pattern in ("core/src/**/*.py", "models/*/src/**/*.py", "plugins/*/src/**/*.py", "**/README.md",
                    "scripts/*.sh", "*.sh"):
        for path in ROOT.glob(pattern):
            if ".venv" not in path.parts:
                yield path


def test_no_hint_installs_one_of_our_distributions_by_name():
    bad = []
    for path in _hint_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for tail in re.findall(r"pip install (.*)", line):
                names = [token.strip("'\"`(),:;") for token in tail.split() if not token.startswith("-")]
                # a hyphenated or extras spelling anywhere; a bare `verispec` as the first requirement
                # (later words may be prose: "... ship in the verispec repository")
                if any(re.match(r"verispec(-|\[)", n) for n in names) or names[:1] == ["verispec"]:
                    bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bad == []


@pytest.mark.parametrize("hint", [DEFAULT_CHECKPOINT_INSTALL, install_hint("plugins/ngram", "models/llama"),
                                  format_plugin_table([])])
def test_runtime_hints_name_paths_that_hold_a_distribution(hint):
    paths = re.findall(r"-e (\S+)", hint)
    assert paths
    for path in paths:
        assert (Path(path) / "pyproject.toml").is_file(), path
    assert "not on PyPI" in hint and "scripts/setup.sh" in hint


def test_the_unknown_architecture_hint_names_the_model_directories():
    from verispec.registry import UnknownArchitecture

    message = str(UnknownArchitecture("qwen35", ["gemma3"]))
    assert all(f"-e {ROOT}/models/{family} " in message for family in ("gemma4", "llama", "qwen35"))
    assert "verispec-gemma4" not in message
    assert "verispec-dflash" not in str(UnknownArchitecture("dflash", [], kind="draft_file"))
    assert choose_speculator(Registry.from_plugins({}), "auto", None, max_draft_tokens=8).reason.endswith(
        "not on PyPI; " f"{ROOT}/scripts/setup.sh installs every distribution))")
