"""llama.cpp b11434 loads and runs the heads our writer writes: `llama-speculative-simple
--spec-type draft-eagle3` with the tiny target and a tiny random head (F32, and Q8_0 linears as
`llama-quantize` leaves them) loads, reads the target layers and the trimmed vocabulary from it,
and drafts (its closing `n_drafted` line; a run that lost it is repeated: `run_llama_cpp`). A
random head's drafts are all rejected there as here; what this checks is the format: llama.cpp's
eagle3 loader (src/models/eagle3.cpp) takes the file's keys, tensor names and shapes, and its
graph runs on them.

Runs only where llama.cpp is built (`python benchmarks/llama_cpp.py --build`; CI does not build it,
so there it skips). Both files say `tokenizer.ggml.pre` "default": llama.cpp refuses "gpt2" for a
vocabulary that is not GPT-2's.
"""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
llama_cpp = pytest.importorskip("llama_cpp", reason="benchmarks/llama_cpp.py not found")  # our script, not the pip package
from tiny_eagle3 import build_target, head_tensors, write_head  # noqa: E402
from tiny_llama import write_fixture  # noqa: E402
from verispec.testing import run_llama_cpp  # noqa: E402

PROMPT = "abc abc abc"
DEFAULT_PRE = {"tokenizer.ggml.pre": "default"}


@pytest.mark.parametrize("tensor_types", [None, "Q8_0"], ids=["f32", "q8_0"])
def test_llama_cpp_loads_and_runs_our_head(tmp_path, tensor_types):
    spec_binary = llama_cpp.built("llama-speculative-simple") or pytest.skip(
        "llama.cpp's llama-speculative-simple is not built: python benchmarks/llama_cpp.py --build")
    target = write_fixture(build_target(), tmp_path / "target.gguf", extra_metadata=DEFAULT_PRE)
    tensors, d2t = head_tensors(0)
    types = None if tensor_types is None else {  # as test_parity's Q8_0 file: every matrix of whole blocks
        name: tensor_types for name, t in tensors.items() if t.dim() == 2 and t.shape[1] % 32 == 0}
    head = write_head(tmp_path / "head.gguf", tensors, d2t, extra_metadata=DEFAULT_PRE, tensor_types=types)
    status, spec = run_llama_cpp(spec_binary, ["-m", target, "-md", head, "--spec-type", "draft-eagle3", "-p", PROMPT,
                                               "-n", "16", "--temp", "0", "-t", "1", "-c", "256",
                                               "-v"],  # -v: the loader's EAGLE3 lines
                                 tmp_path / "spec.log", attempts=5,  # b11434's logger can drop lines under load
                                 complete=lambda out: all(line in out for line in (
                                     "n_drafted", "EAGLE3 using d2t mapping", "EAGLE3 extract_layers")))
    assert status == 0, spec[-3000:]
    assert re.search(r"EAGLE3 using d2t mapping \(draft_vocab_size = 40\)", spec)
    assert re.search(r"EAGLE3 extract_layers = \[1, 2, 4\]", spec)
    drafted = re.search(r"n_drafted = (\d+)", spec)
    assert drafted and int(drafted.group(1)) > 0, spec[-3000:]
    assert "error loading model" not in spec
