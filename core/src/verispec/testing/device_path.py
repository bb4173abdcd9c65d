"""Checks of a trunk placed on a device (`TrunkModule.to_device`), shared by every family that
declares "cuda": run on the CPU with `to_device("cpu")`, VERISPEC_TRITON=1 and TRITON_INTERPRET=1
(the code a CUDA trunk runs, Triton's interpreter running the kernels), or on a GPU.

- `count_device_kernels`: counts the Triton kernels' calls; `forbid_c_kernels`: any C kernel call fails.
- `greedy`: a plain greedy decode with every step's logits.
- `assert_keep_after_a_rejected_draft`, `assert_two_sequences_are_each_alone`,
  `assert_speculative_stream_is_plain`: the seam's exactness on the placed trunk
  (`gguf_weights.assert_verify_rows_are_one_row_decodes` checks its verify rows).
- `PlacedTrunkSuite`: those checks as a test class a family's tests subclass.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PlacedTrunkSuite", "assert_keep_after_a_rejected_draft", "assert_speculative_stream_is_plain", "assert_two_sequences_are_each_alone",
           "count_device_kernels", "forbid_c_kernels", "greedy"]


def count_device_kernels(monkeypatch) -> dict[str, int]:
    """Wraps the Triton kernels (triton_qmatmul.qmatmul, triton_attend.attend, triton_norm.rms_norm,
    triton_glu.glu, triton_delta_rule.delta_rule) to count their
    calls in the returned dict, and makes any C kernel call raise AssertionError, until the
    pytest `monkeypatch` undoes it."""
    from verispec.kernels import triton_attend, triton_delta_rule, triton_glu, triton_norm, triton_qmatmul

    counts = {"qmatmul": 0, "attend": 0, "rms_norm": 0, "glu": 0, "delta_rule": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(triton_qmatmul, "qmatmul", counting("qmatmul", triton_qmatmul.qmatmul))
    monkeypatch.setattr(triton_attend, "attend", counting("attend", triton_attend.attend))
    monkeypatch.setattr(triton_norm, "rms_norm", counting("rms_norm", triton_norm.rms_norm))
    monkeypatch.setattr(triton_glu, "glu", counting("glu", triton_glu.glu))
    monkeypatch.setattr(triton_delta_rule, "delta_rule", counting("delta_rule", triton_delta_rule.delta_rule))
    forbid_c_kernels(monkeypatch)
    return counts


def forbid_c_kernels(monkeypatch) -> None:
    """Makes any C kernel call (`ckernels.library()`) raise AssertionError until `monkeypatch` undoes it."""
    from verispec.kernels import ckernels

    class Guard:
        def __getattr__(self, name):
            raise AssertionError(f"the device path called the C kernel {name}")

    monkeypatch.setattr(ckernels, "library", lambda: Guard())


def greedy(trunk, prompt: Sequence[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decode of `steps` tokens: (tokens, every step's logits fp32 [steps, V] on the CPU)."""
    from verispec.testing import forward_one

    seq = trunk.new_sequence()
    logits = [forward_one(trunk, seq, prompt, logits="last").logits[-1]]
    tokens = []
    for _ in range(steps - 1):
        tokens.append(int(logits[-1].argmax()))
        logits.append(forward_one(trunk, seq, tokens[-1:], logits="last").logits[-1])
    tokens.append(int(logits[-1].argmax()))
    trunk.release(seq)
    return tokens, torch.stack(logits).cpu()


def assert_speculative_stream_is_plain(trunk, prompt: Sequence[int], speculator, steps: int = 12) -> None:
    """Speculative greedy with `speculator(plain)` (a Speculator; plain: the prompt and plain
    greedy's tokens, for an oracle drafter) at 4 draft tokens at most emits plain greedy's
    tokens, with drafts accepted."""
    from verispec.testing import run_greedy_requests

    plain = [tokens for tokens, _ in run_greedy_requests(trunk, [prompt], steps)]
    spec = run_greedy_requests(trunk, [prompt], steps, speculator(list(prompt) + plain[0]), max_draft_tokens=4,
                               max_running=1)
    assert [tokens for tokens, _ in spec] == plain
    assert sum(e.stats.num_accepted_tokens for _, e in spec) > 0, "no draft was accepted: speculation untested"


def assert_two_sequences_are_each_alone(trunk, prompt: Sequence[int]) -> None:
    """Two sequences in one forward (a 1-row verify beside a 2-row decode chunk) give each the
    logits it gets alone, bitwise. `prompt`: at least 10 tokens."""
    from verispec.seams import Segment
    from verispec.testing import forward_one

    seqs = [trunk.new_sequence() for _ in range(2)]
    for s, start in zip(seqs, (0, 3)):
        forward_one(trunk, s, prompt[start:start + 5], logits="last")
    both = trunk.forward([Segment(seqs[0], [prompt[5]], verify=True, logits="all"), Segment(seqs[1], prompt[8:10])])
    for s in seqs:
        trunk.release(s)
    for out, (start, nxt) in zip(both, ((0, [prompt[5]]), (3, prompt[8:10]))):
        s = trunk.new_sequence()
        forward_one(trunk, s, prompt[start:start + 5], logits="last")
        alone = forward_one(trunk, s, nxt, logits="last").logits[-1]
        trunk.release(s)
        assert torch.equal(out.logits[-1], alone)


def assert_keep_after_a_rejected_draft(trunk, prompt: Sequence[int], *, truncate: bool = True) -> None:
    """`keep` after a 4-row verify whose last 2 rows are rejected leaves every layer's state (KV
    caches, recurrent states) as a plain run's, and what follows is bitwise the plain run's; so
    does a truncate back past the kept rows (prefix reuse; `truncate=False` for a trunk with
    recurrent state, which refuses it). `prompt`: at least 10 tokens."""
    from verispec.testing import forward_one

    plain = trunk.new_sequence()
    forward_one(trunk, plain, list(prompt[:10]) + [40, 41], logits="last")
    spec = trunk.new_sequence()
    forward_one(trunk, spec, prompt[:10], logits="last")
    forward_one(trunk, spec, [40, 41, 42, 43], verify=True)  # 42, 43 rejected
    trunk.keep(spec, 2)
    assert trunk.seq_len(spec) == trunk.seq_len(plain) == 12
    for a, b in zip(trunk._state(spec).layers, trunk._state(plain).layers):
        if hasattr(a, "read"):  # a KV cache
            ka, va, _ = a.read(12)
            kb, vb, _ = b.read(12)
            assert torch.equal(ka, kb) and torch.equal(va, vb)
        else:  # a recurrent state
            assert all(torch.equal(a.values[name], b.values[name]) for name in a.values)
    nxt = [forward_one(trunk, s, [44, 45], logits="all").logits for s in (spec, plain)]
    assert torch.equal(nxt[0], nxt[1])
    if truncate:
        trunk.truncate(spec, 10)
        again = forward_one(trunk, spec, [40, 41, 44, 45], logits="all").logits[2:]
        assert torch.equal(again, nxt[1])
    for s in (spec, plain):
        trunk.release(s)


class PlacedTrunkSuite:
    """The checks above as tests: subclass it as `Test...` in a family's tests, beside a `trunks`
    fixture giving (the CPU trunk, the same file's placed trunk), and set the class attributes."""

    #: a prompt of at least 10 tokens; `verify_tokens` extends past it for the verify check
    prompt: Sequence[int]
    verify_tokens: Sequence[int]
    verify_prefix = 8
    verify_rows = 9
    #: tokens the speculative stream check decodes
    stream_steps = 12
    #: False for a trunk with recurrent state (it refuses to truncate)
    truncate = True

    def speculator(self, trunk, plain: Sequence[int]):
        """The Speculator for the stream check (`assert_speculative_stream_is_plain`)."""
        raise NotImplementedError

    def test_speculative_greedy_is_the_plain_stream(self, trunks):
        assert_speculative_stream_is_plain(trunks[1], self.prompt, lambda plain: self.speculator(trunks[1], plain),
                                           steps=self.stream_steps)

    def test_verify_rows_are_one_row_decodes(self, trunks):
        from verispec.testing.gguf_weights import assert_verify_rows_are_one_row_decodes

        assert_verify_rows_are_one_row_decodes(trunks[1], self.verify_tokens, prefix=self.verify_prefix,
                                               max_rows=self.verify_rows)

    def test_two_sequences_in_one_forward_are_each_alone(self, trunks):
        assert_two_sequences_are_each_alone(trunks[1], self.prompt)

    def test_keep_after_a_rejected_draft_leaves_a_plain_runs_state(self, trunks):
        assert_keep_after_a_rejected_draft(trunks[1], self.prompt, truncate=self.truncate)
