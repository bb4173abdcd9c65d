"""Fixtures for the glm5 tests; the helpers live in `tiny_glm4moe.py` (on pytest's `pythonpath`,
set in the workspace's pyproject.toml)."""
import pytest
import tiny_glm_dsa
from tiny_glm4moe import build_hf_model, write_fixture

from verispec.testing import built_once


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every module runs torch on one thread (verispec.testing.plugin.one_thread)."""


def _build(name, directory):
    model, mtp = build_hf_model(name)
    return model, mtp, write_fixture(model, directory / f"{name}.gguf", mtp=mtp)


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """tiny_fixture(name) -> (transformers model, its MtpModel or None, GGUF path), once per session."""
    return built_once(tmp_path_factory, _build)


def _build_dsa(name, directory):
    model, mtp = tiny_glm_dsa.build_hf_model(name)
    return model, mtp, tiny_glm_dsa.write_fixture(model, directory / f"dsa-{name}.gguf", mtp=mtp)


@pytest.fixture(scope="session")
def tiny_dsa_fixture(tmp_path_factory):
    """tiny_dsa_fixture(name) -> (transformers GlmMoeDsaForCausalLM, its NextN MtpLayer or None, GGUF
    path), once per session."""
    return built_once(tmp_path_factory, _build_dsa)


def _build_glm5next(name, directory):
    import tiny_glm5next

    model = tiny_glm5next.build_hf_model(name)
    return model, tiny_glm5next.write_fixture(model, directory / f"glm5next-{name}.gguf")


@pytest.fixture(scope="session")
def tiny_glm5next_fixture(tmp_path_factory):
    """tiny_glm5next_fixture(name) -> (tiny_glm5next.TinyGlm5Next, GGUF path), once per session."""
    return built_once(tmp_path_factory, _build_glm5next)
