"""Fixtures for the DFlash tests. `tiny_dflash.py` (the helpers) sits beside this file; the trunk
helpers (`tiny_llama`, `tiny_gemma`) are on pytest's pythonpath (the workspace's pyproject.toml)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tiny_dflash, under --import-mode=importlib


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """(transformers llama target, its GGUF path, our fp32 trunk of it): tiny_dflash.TARGET, built once."""
    pytest.importorskip("verispec_llama", reason="the tiny target trunk's family: pip install -e models/llama")
    from tiny_dflash import build_target
    from tiny_llama import write_fixture
    from verispec_llama.loader import load

    hf = build_target()
    path = write_fixture(hf, tmp_path_factory.mktemp("target") / "target.gguf")
    return hf, path, load(path, dtype="float32")


@pytest.fixture(scope="session")
def drafter_file(tmp_path_factory, target):
    """drafter_file(variant, **make_drafter kwargs) -> (reference drafter, GGUF path), built once per arguments."""
    pytest.importorskip("dflash.model", reason="the reference oracle: pip install --no-deps dflash==0.1.0")
    from tiny_dflash import TARGET, make_drafter
    from verispec.testing.fixture_writer import byte_level_vocab
    from verispec_dflash.gguf_writer import write_dflash_gguf

    made, directory = {}, tmp_path_factory.mktemp("drafters")

    def _get(variant, **kwargs):
        key = (variant, tuple(sorted(kwargs.items())))
        if key not in made:
            model = make_drafter(variant, **kwargs)
            name = "-".join([variant] + [f"{k}{v}" for k, v in sorted(kwargs.items())]).replace(" ", "")
            made[key] = model, write_dflash_gguf(directory / f"{name}.gguf", model,
                                                 vocab=byte_level_vocab(TARGET["vocab_size"]))
        return made[key]

    return _get
