"""Fixtures for the assistant tests. `tiny_assistant.py` (the helpers) sits beside this file; the
Gemma trunk helpers (`tiny_gemma`) are on pytest's pythonpath (the workspace's pyproject.toml)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tiny_assistant, under --import-mode=importlib


@pytest.fixture(scope="session")
def pair_files(tmp_path_factory):
    """pair_files(name) -> (hf target, hf assistant, trunk GGUF path, assistant GGUF path), built once per name."""
    from tiny_assistant import make_pair

    made = {}

    def _get(name):
        if name not in made:
            made[name] = make_pair(name, tmp_path_factory.mktemp(name))
        return made[name]

    return _get
