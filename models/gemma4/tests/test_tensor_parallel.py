"""Tensor-parallel Gemma 3 trunks: 2 ranks on loopback (gloo, one thread each) against the
single-process trunk of the same GGUF (as models/llama/tests/test_tensor_parallel.py).

The tiny Gemma 3 here has 4 query and 2 KV heads (the shared fixture's 3 and 1 do not divide by
2: it is the refusal case), odd V and F (uneven vocabulary and FFN shares), sliding and full
layers, and a final logit softcap of 5 (tanh well off linear), so the softcap-after-gather path
is exercised. Exactness: the o/down all-reduce sums two half dot products, so logits are not
bitwise world size 1's; the teacher-forced per-row error must stay within TP_LOGIT_BOUND, an
argmax may differ only where world size 1's top-2 margin is inside twice that row's error, and
the greedy streams (n-gram speculation on) are required equal.
"""
import pytest
import torch
from tiny_gemma import make_hf_gemma3, write_gemma3_gguf
from verispec.errors import UnsupportedVariant
from verispec.nn.parallel import HeadsNotDivisible, Shards
from verispec.tensor_parallel import load_parallel_trunk
from verispec.testing import assert_rows_within, run_greedy_requests, teacher_forced_logits
from verispec_gemma4.loader import load
from verispec_ngram.speculator import NGramSpeculator

#: max |Δlogit| vs world size 1 that a 2-rank fp32 row may show (measured 7.8e-6 on this model, 0 argmax flips).
TP_LOGIT_BOUND = 1e-4
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 30, 31, 32, 129, 70, 66, 65]


@pytest.fixture(scope="module")
def tp_gguf(tmp_path_factory):
    """A tiny gemma3 GGUF whose head counts (4, 2) divide by 2, with a final logit softcap."""
    hf = make_hf_gemma3(seed=3, num_attention_heads=4, num_key_value_heads=2)
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3_tp") / "tiny-gemma3-tp.gguf", hf,
                             extra_metadata={"gemma3.final_logit_softcapping": 5.0})


@pytest.fixture(scope="module")
def trunks(tp_gguf):
    """(world size 1 trunk, 2-rank BroadcastTrunk); one group per module (~2 s)."""
    ref = load(tp_gguf, dtype="fp32", use_cache=False, tokenizer=False)
    tp = load_parallel_trunk(load, tp_gguf, world_size=2, dtype="fp32", threads=1)
    yield ref, tp
    tp.close()


def test_rank_holds_its_share_and_the_seam_the_whole_model(tp_gguf):
    rank1 = load(tp_gguf, dtype="fp32", use_cache=False, tokenizer=False, shards=Shards(1, 2))
    a, mlp = rank1.model.layers[0].self_attn, rank1.model.layers[0].mlp
    assert (a.num_heads, a.num_kv_heads, mlp.intermediate_size) == (2, 1, 18)  # F = 37: 19 | 18
    assert rank1.model.embed_tokens.weight.shape[0] == 65 and rank1.vocab_size == 131  # V = 131: 66 | 65
    assert rank1.final_logit_softcap == 5.0


def test_teacher_forced_rows_within_bound_and_argmax_flips_only_in_ties(trunks):
    ref, tp = trunks
    a, b = teacher_forced_logits(ref, PROMPT), teacher_forced_logits(tp, PROMPT)
    assert a.shape == (len(PROMPT), ref.vocab_size)
    assert a.abs().max() <= 5.0 and a.abs().max() > 2.0  # the softcap bites
    assert_rows_within(a, b, TP_LOGIT_BOUND)
    # the view's collectives: embed (vocabulary-parallel, exact) and logits (gather, then softcap)
    tokens = torch.tensor([0, 65, 66, 130])  # both sides of the 66 | 65 cut
    torch.testing.assert_close(tp.view().embed(tokens), ref.view().embed(tokens), atol=0, rtol=0)
    hidden = torch.randn(3, ref.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tp.view().logits(hidden), ref.view().logits(hidden), atol=TP_LOGIT_BOUND, rtol=0)


def test_greedy_streams_equal_world_size_1_with_ngram(trunks):
    ref, tp = trunks
    prompts = [PROMPT, [7, 3, 11, 4, 7, 3, 11, 4, 7, 3]]
    plain = [tokens for tokens, _ in run_greedy_requests(ref, prompts, 20)]
    ngram = NGramSpeculator(max_draft_tokens=4)
    alone = run_greedy_requests(tp, prompts, 20, ngram, max_draft_tokens=4, max_running=1)  # every step drafts
    assert [tokens for tokens, _ in alone] == plain
    assert sum(e.stats.num_accepted_tokens for _, e in alone) > 0, "no draft was accepted: speculation untested"


def test_world_size_that_does_not_divide_the_heads_is_refused(gemma3_gguf, tp_gguf):
    # the shared tiny gemma3: 3 attention heads, 1 KV head (refused before any rank is spawned)
    with pytest.raises(HeadsNotDivisible, match=r"3 attention heads, 1 KV head, .*cannot be split: leave --tp out$"):
        load_parallel_trunk(load, gemma3_gguf, world_size=2, dtype="fp32")
    with pytest.raises(HeadsNotDivisible, match=r"4 attention heads, 2 KV heads.*--tp among 2 \(or leave it out\)$"):
        load(tp_gguf, dtype="fp32", use_cache=False, tokenizer=False, shards=Shards(0, 3))


def test_gemma4_has_no_tensor_parallel_form_and_says_so(tmp_path):
    from verispec.testing.fixture_writer import write_gguf

    path = write_gguf(tmp_path / "g4.gguf", arch="gemma4", metadata={}, tensors={"token_embd.weight": torch.zeros(4, 4)},
                      vocab=None)
    with pytest.raises(UnsupportedVariant, match="tensor parallelism.*gemma4.*only gemma3"):
        load(path, dtype="fp32", use_cache=False, shards=Shards(0, 2))
    # through the registry (--tp): refused by the family's declaration, before a rank is spawned
    from verispec.errors import VerispecError
    from verispec.model_files import load_registered_trunk
    from verispec.registry import Registry

    with pytest.raises(VerispecError, match=r"--tp 2: gemma4 files have no tensor-parallel form yet in the gemma "
                                            r"trunk \(it has one for gemma3\)"):
        load_registered_trunk(str(path), Registry.discover(), tensor_parallel=2)
