"""SpecTrunk implementations: the batched regime gives the same streams as the linear one."""
import random

import pytest

from verispec.execution import SpeculativeExecution
from verispec.sampling import Sampler, SamplingParams
from verispec.seams import ContextOverflow
from verispec.testing import ToyTarget, oracle_speculator, run_greedy
from verispec.testing.toy import ToyBatchedTarget
from verispec.trunks import BatchedSpecTrunk, LinearSpecTrunk

PROMPTS = ([1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 9, 9, 2])


@pytest.mark.parametrize("recurrent", [True, False])
def test_interleaved_slots_each_reproduce_the_linear_plain_stream(recurrent):
    n = 40
    expected = [run_greedy(ToyTarget(recurrent=recurrent), p, n)[0] for p in PROMPTS]
    batched = ToyBatchedTarget(2, recurrent=recurrent)
    runs = []
    for slot, prompt in enumerate(PROMPTS):
        speculator = oracle_speculator(prompt + expected[slot], vocab_size=32, rng=random.Random(slot))
        ex = SpeculativeExecution(BatchedSpecTrunk(batched, slot), speculator)
        out = []
        on_token = (lambda out: lambda d: out.append(d.token) or len(out) >= n)(out)
        sampler = Sampler(SamplingParams(), prompt, 32)
        runs.append([ex, sampler, on_token, out, ex.start(prompt, sampler, on_token)])
    while not all(r[4] for r in runs):
        for r in runs:  # one step per slot in turn: the slots never disturb each other
            if not r[4]:
                r[4] = r[0].step(r[1], r[2])
    assert [r[3] for r in runs] == expected
    assert all(r[0].stats.num_accepted_tokens > 0 for r in runs)


def test_linear_trunk_refuses_a_non_target_and_a_context_overflow():
    with pytest.raises(TypeError, match="SpeculativeTarget"):
        LinearSpecTrunk(object())
    with pytest.raises(TypeError, match="BatchedSpeculativeTarget"):
        BatchedSpecTrunk(object(), 0)
    trunk = LinearSpecTrunk(ToyTarget(max_context_length=8))
    with pytest.raises(ContextOverflow, match="need 9 positions but the context holds 8"):
        trunk.prefill(list(range(9)), hidden=False)


def test_recurrent_trunks_cannot_rewind_to_reuse_a_prefix():
    trunk = LinearSpecTrunk(ToyTarget(recurrent=True))
    trunk.prefill([1, 2, 3], hidden=False)
    with pytest.raises(ValueError, match="recurrent state cannot be rewound"):
        trunk.rewind(2)
    attention_only = LinearSpecTrunk(ToyTarget(recurrent=False))
    attention_only.prefill([1, 2, 3], hidden=False)
    attention_only.rewind(2)
    assert attention_only.seq_len == 2
