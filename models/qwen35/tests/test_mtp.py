"""The MTP draft head: its steps against an independent reference built from transformers'
modules, its per-sequence KV through commits, keeps and gaps, and exact streams under the
`mtp` speculator (when verispec-mtp-nextn is installed)."""
import pytest
import torch
from tiny_qwen35 import HfMtpReference
from verispec.seams import DraftHead, DraftHeadKind
from verispec_qwen35.loader import load

pytest.importorskip("transformers")

ATOL = 1e-4


def _reference_and_head(tiny_fixture, name, n=30):
    hf_model, mtp, path = tiny_fixture(name)
    head = load(path, dtype="float32").draft_head
    reference = HfMtpReference(hf_model, mtp).eval()
    tokens = torch.randint(0, hf_model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = hf_model(tokens[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed [n, D]
    return reference, head, tokens, hidden


@pytest.mark.parametrize("name", ["dense_mtp", "moe_fused_mtp"])
def test_draft_steps_match_the_reference(tiny_fixture, name):
    """Commits in chunks as the loop makes them, a first step per chunk (catch-up folded in) and one
    chained step on the head's own row, provisional rows dropped by keep: every logits row equals
    the reference over the pairs (h[j], t[j+1]) at position j+1 (+ the chained pair)."""
    reference, head, tokens, hidden = _reference_and_head(tiny_fixture, name)
    assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
    with torch.no_grad():
        ref_logits, ref_hidden = reference(tokens[1:], hidden[:-1], torch.arange(1, len(tokens)))
    state = head.new_state()
    head.draft_catch_up(state, tokens[:10].tolist(), hidden[:10], 0)
    pos = 10
    for kept in (3, 1, 5, 2, 4):
        logits, h_out = head.draft_step(state, int(tokens[pos]), hidden[pos - 1], pos)
        torch.testing.assert_close(logits, ref_logits[pos - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(h_out, ref_hidden[pos - 1], atol=ATOL, rtol=0)
        draft = int(logits.argmax())
        chained, _ = head.draft_step(state, draft, h_out, pos + 1)
        with torch.no_grad():
            expected, _ = reference(torch.cat([tokens[1:pos + 1], torch.tensor([draft])]),
                                    torch.cat([hidden[:pos], ref_hidden[pos - 1:pos]]),
                                    torch.arange(1, pos + 2))
        torch.testing.assert_close(chained, expected[-1], atol=ATOL, rtol=0)
        head.keep(state, kept)
        head.draft_catch_up(state, tokens[pos:pos + kept].tolist(), hidden[pos:pos + kept], pos)
        pos += kept


def test_head_restarts_after_a_gap(tiny_fixture):
    """Tokens committed without hidden rows (prefix reuse): the head's KV restarts at the next pair
    it can form, and steps equal the reference run over only those pairs."""
    reference, head, tokens, hidden = _reference_and_head(tiny_fixture, "dense_mtp")
    state = head.new_state()
    head.draft_catch_up(state, tokens[:8].tolist(), hidden[:8], 0)
    head.draft_step(state, int(tokens[8]), hidden[7], 8)
    head.keep(state, 1)
    head.draft_catch_up(state, tokens[8:14].tolist(), None, 8)  # a gap: no hidden rows
    head.draft_catch_up(state, tokens[14:20].tolist(), hidden[14:20], 14)
    logits, _ = head.draft_step(state, int(tokens[20]), hidden[19], 20)
    with torch.no_grad():  # pairs (h[j], t[j+1]) for j = 14..19 at positions 15..20
        expected, _ = reference(tokens[15:21], hidden[14:20], torch.arange(15, 21))
    torch.testing.assert_close(logits, expected[-1], atol=ATOL, rtol=0)


def test_no_mtp_block_no_head(tiny_fixture):
    _, _, path = tiny_fixture("dense")
    assert load(path, dtype="float32").draft_head is None


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_mtp_speculation_gives_the_plain_stream(tiny_fixture, dtype):
    speculator_mod = pytest.importorskip("verispec_mtp_nextn.speculator")
    from verispec.testing import run_greedy

    _, _, path = tiny_fixture("moe_fused_mtp")
    trunk = load(path, dtype=dtype)
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    plain = run_greedy(trunk, prompt, 48)[0]
    speculator = speculator_mod.MtpSpeculator(trunk.draft_head, max_draft_tokens=4, min_draft_prob=0.0)
    got, ex = run_greedy(trunk, prompt, 48, speculator, max_draft_tokens=4)
    assert got == plain
    assert ex.stats.num_draft_tokens > 0 and ex.stats.num_spec_steps > 0


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_one_speculator_serves_requests_in_turn(tiny_fixture, kind):
    """Per-sequence state on this trunk: two requests of one scheduler sharing one speculator (the
    MTP head's KV is per sequence), run alone in turn, each give their plain stream and the
    draft/accept counts they get alone."""
    from verispec.testing import run_greedy, run_greedy_requests

    if kind == "mtp":
        make = pytest.importorskip("verispec_mtp_nextn.speculator").MtpSpeculator
    else:
        make = pytest.importorskip("verispec_ngram.speculator").NGramSpeculator
    _, _, path = tiny_fixture("dense_mtp")
    trunk = load(path, dtype="int8")

    def new():
        return make(trunk.draft_head, max_draft_tokens=3, min_draft_prob=0.0) if kind == "mtp" \
            else make(max_draft_tokens=3)

    prompts = [[1, 5, 9, 2, 7, 3, 11, 4] * 2, [8, 6, 10, 12, 40, 77, 101, 3, 8, 6]]
    plains = [run_greedy(trunk, p, 32)[0] for p in prompts]
    solos = [run_greedy(trunk, p, 32, new(), max_draft_tokens=3)[1].stats for p in prompts]
    runs = run_greedy_requests(trunk, prompts, 32, new(), max_running=1, max_draft_tokens=3)
    assert [tokens for tokens, _ in runs] == plains
    assert [ex.stats for _, ex in runs] == solos


# -- a standalone MTP GGUF paired with a main file without one (docs/reference/qwen35.md §3.7, variant 3) --

def _split_files(tiny_fixture, tmp_path, name="dense_mtp"):
    """(main GGUF without the MTP block, the MTP-only GGUF, the combined GGUF) of one model."""
    from tiny_qwen35 import hf_to_gguf, write_fixture

    hf_model, mtp, combined = tiny_fixture(name)
    _, _, tensors = hf_to_gguf(hf_model, mtp)
    n_main = hf_model.config.num_hidden_layers
    main = write_fixture(hf_model, tmp_path / "main.gguf")
    keep = ("token_embd.weight", "output_norm.weight", "output.weight")
    mtp_only = write_fixture(hf_model, tmp_path / "mtp-model.gguf", mtp=mtp,
                             drop_tensors=[k for k in tensors if not (k.startswith(f"blk.{n_main}.") or k in keep)])
    return main, mtp_only, combined


def test_a_standalone_mtp_file_drafts_as_the_block_inside_a_main_file(tiny_fixture, tmp_path):
    from verispec_qwen35.loader import load_mtp_file

    main, mtp_only, combined = _split_files(tiny_fixture, tmp_path)
    trunk = load(main, dtype="float32", use_cache=False)
    assert trunk.draft_head is None
    head = load_mtp_file(mtp_only, trunk, use_cache=False)
    inside = load(combined, dtype="float32", use_cache=False).draft_head
    tokens = list(range(3, 15))
    hidden = torch.randn(len(tokens), trunk.config.hidden_size, generator=torch.Generator().manual_seed(1))
    got, want = head.new_state(), inside.new_state()
    head.draft_catch_up(got, tokens[:8], hidden[:8], 0)
    inside.draft_catch_up(want, tokens[:8], hidden[:8], 0)
    logits, h_out = head.draft_step(got, tokens[8], hidden[7], 8)
    expected, h_expected = inside.draft_step(want, tokens[8], hidden[7], 8)
    assert torch.equal(logits, expected) and torch.equal(h_out, h_expected)


def test_standalone_mtp_file_errors_name_the_fix(tiny_fixture, tmp_path):
    from verispec_qwen35.loader import load_mtp_file
    from verispec_qwen35.modeling_qwen35 import UnsupportedQwen35Variant

    main, mtp_only, combined = _split_files(tiny_fixture, tmp_path)
    with pytest.raises(UnsupportedQwen35Variant, match="pass this file as --draft-model"):
        load(mtp_only)
    trunk = load(main, dtype="float32", use_cache=False)
    with pytest.raises(UnsupportedQwen35Variant, match="a main GGUF .* not a standalone MTP file"):
        load_mtp_file(combined, trunk)
    other = load(tiny_fixture("dense_tied")[2], dtype="float32", use_cache=False)  # another vocab and FFN
    with pytest.raises(UnsupportedQwen35Variant, match=r"another trunk: vocab_size 131 \(trunk 137\)"):
        load_mtp_file(mtp_only, other)


def test_mtp_speculation_through_draft_model(tiny_fixture, tmp_path):
    pytest.importorskip("verispec_mtp_nextn")
    import verispec

    main, mtp_only, _ = _split_files(tiny_fixture, tmp_path)
    plain = verispec.load(main, dtype="float32", enabled=False)
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
    want = [e.token for e in plain.generate(prompt, max_tokens=32, ignore_eos=True)]
    engine = verispec.load(main, dtype="float32", spec_type="mtp", draft_model=mtp_only, adaptive=False)
    generation = engine.generate(prompt, max_tokens=32, ignore_eos=True)
    got = [e.token for e in generation]
    assert got == want and generation.result.speculator == "mtp"
    assert generation.result.spec.num_draft_tokens > 0
