"""One tiny GGUF per installed trunk family, for the tests that hold every family's loader to
the same rules (tests/test_trunk_loaders.py, tests/test_hostile_files.py).

Each family's own tests build a seeded random transformers model and map it to llama.cpp's
names (`models/<family>/tests/tiny_*.py`); `tiny_trunks` reuses those maps, so a fixture here
is exactly what the family's parity tests load. A family whose package or test map is absent
(a removed distribution) is skipped with the reason.
"""
import importlib
import importlib.util
from pathlib import Path

import attrs
import pytest

_MODELS = Path(__file__).resolve().parent.parent / "models"


@attrs.frozen
class TinyTrunk:
    """A family's tiny GGUF as parts (so tests write variants of it) and the loader it goes to."""

    arch: str
    metadata: dict
    tensors: dict  # GGUF name -> torch.Tensor (torch order)
    load: object  # the family's TrunkSpec loader, `load(path, dtype=..., use_cache=..., tokenizer=...)`

    def write(self, path, *, metadata=None, tensors=None, drop=()) -> str:
        """Write the fixture at `path`; `metadata` / `tensors` add or override, `drop` removes tensors."""
        from verispec.testing.fixture_writer import write_gguf

        merged = {k: v for k, v in {**self.tensors, **(tensors or {})}.items() if k not in drop}
        return write_gguf(path, arch=self.arch, metadata={**self.metadata, **(metadata or {})}, tensors=merged)


def _llama():
    from tiny_llama import build_hf_model, hf_to_gguf

    return hf_to_gguf(build_hf_model("llama_int8"))


def _nemotron():
    from tiny_nemotron import build_hf_model, hf_to_gguf

    return hf_to_gguf(build_hf_model("dense"))


def _qwen35():
    from tiny_qwen35 import TINY_CONFIGS, build_hf_model, hf_to_gguf

    model, mtp = build_hf_model("dense")
    return hf_to_gguf(model, mtp, TINY_CONFIGS["dense"][3])


def _gemma3():
    from tiny_gemma import gemma3_gguf_metadata, gemma3_gguf_tensors, make_hf_gemma3

    hf = make_hf_gemma3()
    return "gemma3", gemma3_gguf_metadata(hf.config), gemma3_gguf_tensors(hf)


def _gemma4():
    from tiny_gemma import TINY_GEMMA4_PLE, gemma4_gguf_metadata, gemma4_gguf_tensors, make_hf_gemma4

    hf = make_hf_gemma4(TINY_GEMMA4_PLE)
    return "gemma4", gemma4_gguf_metadata(hf.config), gemma4_gguf_tensors(hf)


#: fixture name -> (model package, its test-map directory, the builder of (arch, metadata, tensors)).
FAMILIES = {
    "llama": ("verispec_llama", "llama", _llama),
    "nemotron_h": ("verispec_nemotron", "nemotron", _nemotron),
    "qwen35": ("verispec_qwen35", "qwen35", _qwen35),
    "gemma3": ("verispec_gemma4", "gemma4", _gemma3),
    "gemma4": ("verispec_gemma4", "gemma4", _gemma4),
}


@pytest.fixture(scope="session")
def tiny_trunks():
    """tiny_trunks(name) -> the `TinyTrunk` of FAMILIES[name], built once per session."""
    built = {}

    def get(name: str) -> TinyTrunk:
        if name not in built:
            package, directory, build = FAMILIES[name]
            if importlib.util.find_spec(package) is None or not (_MODELS / directory / "tests").is_dir():
                pytest.skip(f"{package} or its tests/ is not installed")
            pytest.importorskip("transformers")
            arch, metadata, tensors = build()  # on one thread: the workspace conftest's `_one_thread`
            loader = importlib.import_module(f"{package}.loader")
            built[name] = TinyTrunk(arch, dict(metadata), dict(tensors), loader.load)
        return built[name]

    return get


@pytest.fixture(scope="session")
def trunk_families():
    """The names `tiny_trunks` takes (installed or not: it skips the absent ones)."""
    return list(FAMILIES)


@pytest.fixture(params=list(FAMILIES))
def tiny_trunk(request, tiny_trunks):
    """Each family's `TinyTrunk` in turn (tests taking it run once per family)."""
    return tiny_trunks(request.param)
