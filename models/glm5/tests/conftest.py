"""Fixtures for the glm5 tests; the helpers live in `glm_archs.py` (the three architectures) and
their test maps `tiny_glm4moe.py`, `tiny_glm_dsa.py`, `tiny_glm5next.py` (on pytest's
`pythonpath`, set in the workspace's pyproject.toml)."""
import pytest
from glm_archs import ARCHS

from verispec.testing import built_once


def _build(key, directory):
    arch, name = ARCHS[key.split(":")[0]], key.split(":")[1]
    model, mtp = arch.build(name)
    return model, mtp, arch.write(model, mtp, directory / f"{arch.name}-{name}.gguf")


@pytest.fixture(scope="session")
def tiny_glm(tmp_path_factory):
    """tiny_glm(arch, name=None) -> (transformers model, its NextN block or None, GGUF path) of the
    architecture's TINY_CONFIGS[name] (default: the config its NextN-head tests run on), built once
    per session."""
    make = built_once(tmp_path_factory, _build)
    return lambda arch, name=None: make(f"{arch}:{name or ARCHS[arch].nextn}")


@pytest.fixture(scope="session")
def tiny_fixture(tiny_glm):
    """tiny_fixture(name) -> (transformers model, its MtpModel or None, GGUF path) of glm4moe."""
    return lambda name: tiny_glm("glm4moe", name)


@pytest.fixture(scope="session")
def tiny_dsa_fixture(tiny_glm):
    """tiny_dsa_fixture(name) -> (transformers GlmMoeDsaForCausalLM, its NextN MtpLayer or None, GGUF path)."""
    return lambda name: tiny_glm("glm-dsa", name)


@pytest.fixture(scope="session")
def tiny_glm5next_fixture(tiny_glm):
    """tiny_glm5next_fixture(name) -> (tiny_glm5next.TinyGlm5Next, GGUF path)."""
    def get(name):
        model, _, path = tiny_glm("glm5-next", name)
        return model, path

    return get
