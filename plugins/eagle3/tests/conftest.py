"""Fixtures for the EAGLE-3 tests. `tiny_eagle3.py` (the helpers) sits beside this file; the trunk helper
`tiny_llama` is on pytest's pythonpath (the workspace's pyproject.toml)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tiny_eagle3, under --import-mode=importlib


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """(transformers llama target, its GGUF path, our fp32 trunk of it): tiny_eagle3.TARGET, built once."""
    pytest.importorskip("verispec_llama", reason="the tiny target trunk's family: pip install -e models/llama")
    pytest.importorskip("transformers", reason="the tiny target is built in transformers: pip install transformers")
    from tiny_eagle3 import build_target
    from tiny_llama import write_fixture
    from verispec_llama.loader import load

    hf = build_target()
    path = write_fixture(hf, tmp_path_factory.mktemp("target") / "target.gguf")
    return hf, path, load(path, dtype="float32")
