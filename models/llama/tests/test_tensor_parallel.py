"""Tensor-parallel llama/qwen2 trunks: 2 ranks on loopback (gloo, one thread each) against the
single-process trunk of the same GGUF.

Rank 0 is this test process (a BroadcastTrunk); rank 1 is spawned by verispec.tensor_parallel.
Exactness: the o/down all-reduce sums two half dot products where one process sums all columns in
its kernel's order, so logits are not bitwise world size 1's. The teacher-forced per-row error
is measured (TP_LOGIT_BOUND states it) and an argmax may differ only where world size 1's top-2
margin is inside twice the measured error; the greedy streams (n-gram speculation on, several
requests at once) are then required equal.
"""
import signal
import time

import pytest
import torch
from verispec.nn.parallel import HeadsNotDivisible, Shards
from verispec.tensor_parallel import RankLost, load_parallel_trunk
from verispec.testing import assert_rows_within, forward_one, run_greedy_requests, teacher_forced_logits
from verispec_llama.loader import load
from verispec_ngram.speculator import NGramSpeculator

#: max |Δlogit| vs world size 1 that a 2-rank fp32 row may show (measured ~9e-6 on tiny qwen2).
TP_LOGIT_BOUND = 1e-4
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 30, 31, 32]


@pytest.fixture
def trunks(tiny_fixture):
    """(world size 1 trunk, 2-rank BroadcastTrunk) of the tiny qwen2 (4 heads, 2 KV heads; odd V and I).
    One group per test (a process joins one default group at a time; ~2 s)."""
    _, path = tiny_fixture("qwen2")
    ref = load(path, dtype="fp32", use_cache=False)
    tp = load_parallel_trunk(load, path, world_size=2, dtype="fp32", threads=1)
    yield ref, tp
    tp.close()


def test_teacher_forced_rows_within_bound_and_argmax_flips_only_in_ties(trunks):
    ref, tp = trunks
    a, b = teacher_forced_logits(ref, PROMPT), teacher_forced_logits(tp, PROMPT)
    assert a.shape == (len(PROMPT), ref.vocab_size)
    assert_rows_within(a, b, TP_LOGIT_BOUND)


def test_rows_agree_across_chunking_at_fixed_world_size(trunks):
    _, tp = trunks
    whole = teacher_forced_logits(tp, PROMPT)
    seq = tp.new_sequence()
    pieces = torch.cat([forward_one(tp, seq, PROMPT[i:i + 5]).logits for i in range(0, len(PROMPT), 5)])
    tp.release(seq)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=0)


def test_greedy_streams_equal_world_size_1_with_ngram_and_concurrent_requests(trunks):
    ref, tp = trunks
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:3], [7, 3, 11, 4, 7, 3, 11, 4, 7, 3]]
    plain = [tokens for tokens, _ in run_greedy_requests(ref, prompts, 24)]
    ngram = NGramSpeculator(max_draft_tokens=4)
    together = run_greedy_requests(tp, prompts, 24, ngram, max_draft_tokens=4)  # batched steps, solo drafts
    assert [tokens for tokens, _ in together] == plain
    alone = run_greedy_requests(tp, prompts, 24, ngram, max_draft_tokens=4, max_running=1)  # every step drafts
    assert [tokens for tokens, _ in alone] == plain
    assert sum(e.stats.num_accepted_tokens for _, e in alone) > 0, "no draft was accepted: speculation untested"


def _state_ops(trunk):
    """keep / fork / truncate on a prefix, then logits that depend on what every rank holds."""
    seq = trunk.new_sequence()
    forward_one(trunk, seq, PROMPT[:10])
    forward_one(trunk, seq, [40, 41, 42, 43], verify=True)
    trunk.keep(seq, 2)  # keep 40, 41: rows 42, 43 must vanish on every rank
    child = trunk.fork(seq, 8)  # the first 8 positions
    trunk.truncate(seq, 11)
    out = [forward_one(trunk, seq, [50, 51]).logits, forward_one(trunk, child, [52, 53, 54]).logits,
           torch.tensor([trunk.seq_len(seq), trunk.seq_len(child)], dtype=torch.float32)[None].expand(1, 2)]
    trunk.release(seq)
    trunk.release(child)
    return out


def test_keep_fork_truncate_across_ranks(trunks):
    ref, tp = trunks
    for a, b in zip(_state_ops(ref), _state_ops(tp)):
        torch.testing.assert_close(b, a, atol=TP_LOGIT_BOUND, rtol=0)
    # a sequence rank 0 refuses is refused on rank 1 as well, and the group stays usable
    with pytest.raises(ValueError, match="unknown sequence"):
        tp.keep(10_000, 1)
    torch.testing.assert_close(teacher_forced_logits(tp, PROMPT[:4]), teacher_forced_logits(ref, PROMPT[:4]),
                               atol=TP_LOGIT_BOUND, rtol=0)


def test_world_size_that_does_not_divide_the_heads_is_refused(tiny_fixture):
    _, path = tiny_fixture("qwen2_tied_linear")  # 3 attention heads, 1 KV head
    with pytest.raises(HeadsNotDivisible, match=r"3 attention heads, 1 KV head, .*cannot be split: leave --tp out"):
        load_parallel_trunk(load, path, world_size=2, dtype="fp32")
    with pytest.raises(HeadsNotDivisible, match=r"4 attention heads, 2 KV heads.*--tp among 2 \(or leave it out\)"):
        load(tiny_fixture("qwen2")[1], dtype="fp32", use_cache=False, shards=Shards(0, 3))


def test_a_killed_rank_gives_a_clear_error_within_the_timeout(tiny_fixture):
    _, path = tiny_fixture("qwen2")
    timeout = 5.0
    tp = load_parallel_trunk(load, path, world_size=2, dtype="fp32", threads=1, timeout_s=timeout)
    try:
        seq = tp.new_sequence()
        forward_one(tp, seq, PROMPT[:6])
        (follower,) = tp._group.followers
        follower.kill()
        follower.wait()
        began = time.monotonic()
        with pytest.raises(RankLost, match=r"rank 1 \(killed by signal 9\) of 2 tensor-parallel ranks stopped answering"):
            forward_one(tp, seq, PROMPT[6:9])
        assert time.monotonic() - began < timeout + 3.0
        with pytest.raises(RankLost):  # and stays lost, at once
            tp.new_sequence()
        tp.release(seq)  # frees rank 0's shard of it (the engine releases a failed request's sequence)
    finally:
        tp.close()


def _stopping_a_follower_is_named(tp, follower: int, message: str, timeout: float) -> None:
    """Stop follower `follower` (alive, sockets open, answering nothing) after one forward: the
    next forward raises RankLost matching `message` within about one collective `timeout`."""
    try:
        seq = tp.new_sequence()
        forward_one(tp, seq, PROMPT[:6])
        tp._group.followers[follower].send_signal(signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(RankLost, match=message):
            forward_one(tp, seq, PROMPT[6:9])
        assert timeout - 0.5 < time.monotonic() - began < timeout + 3.0
    finally:
        for process in tp._group.followers:
            process.kill()
            process.wait()
        tp.close()


def test_a_hung_rank_gives_a_clear_error_once_the_timeout_passes(tiny_fixture):
    _, path = tiny_fixture("qwen2")
    tp = load_parallel_trunk(load, path, world_size=2, dtype="fp32", threads=1, timeout_s=3.0)
    _stopping_a_follower_is_named(tp, 0, r"rank 1 \(stopped by a signal\) of 2 tensor-parallel ranks stopped "
                                         r"answering during forward \(collective timeout 3 s\)", 3.0)


def test_a_hung_rank_of_three_is_named_not_the_rank_that_timed_out_waiting_for_it(tmp_path, monkeypatch):
    """3 ranks, rank 2 stopped: rank 1, alive, times out in the same collective and exits; the
    error still names rank 2, once (within one collective timeout, not two)."""
    import tiny_llama

    monkeypatch.setitem(tiny_llama.TINY_CONFIGS, "qwen2_tp3", ("qwen2", {  # heads and KV heads divide by 3
        "vocab_size": 139, "hidden_size": 48, "intermediate_size": 41, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "tie_word_embeddings": False}))
    path = tiny_llama.write_fixture(tiny_llama.build_hf_model("qwen2_tp3"), tmp_path / "tp3.gguf")
    tp = load_parallel_trunk(load, path, world_size=3, dtype="fp32", threads=1, timeout_s=3.0)
    _stopping_a_follower_is_named(tp, 1, r"^rank 2 \(stopped by a signal\) of 3 tensor-parallel ranks stopped "
                                         r"answering during forward \(collective timeout 3 s\)", 3.0)
