"""verispec's TrunkConformance suite on tiny qwen35 / qwen35moe fixtures, fp32 and int8, and
the recurrent state itself after `keep`.

int8 declares `spec_batch_invariant` (every linear is int8pack_mm, every other op is per row),
so the suite demands bitwise-equal rows there; fp32 (MKL gemm) is held to the suite's atol.
"""
import pytest
import torch
from verispec.nn.state import CannotTruncate, RecurrentState
from verispec.seams import Trunk, declared
from verispec.testing import TrunkConformance, forward_one
from verispec_qwen35.loader import load

pytest.importorskip("transformers")  # the fixtures are written from transformers models


@pytest.fixture(scope="module", params=[("dense_conf", "float32"), ("dense_conf", "int8"),
                                        ("moe_conf", "float32"), ("moe_conf", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tiny_fixture):
    name, dtype = request.param
    _, _, path = tiny_fixture(name)
    return load(path, dtype=dtype)


class TestQwen35Conformance(TrunkConformance):
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3]

    @pytest.fixture
    def trunk(self, loaded):
        return loaded


def test_declarations_are_truthful(loaded):
    assert isinstance(loaded, Trunk)
    assert declared(loaded, "spec_batch_invariant") == (loaded.dtype == "int8")
    assert declared(loaded, "speculation_refusal") is None
    assert 1 <= declared(loaded, "spec_preferred_max_draft_tokens") <= 8
    assert loaded.view().tap_feature_size(None) == loaded.hidden_size
    assert loaded.draft_head is None  # these fixtures carry no MTP block


def _recurrent_values(trunk, seq) -> list[dict[str, torch.Tensor]]:
    return [dict(s.values) for s in trunk._state(seq).layers if isinstance(s, RecurrentState)]


def test_state_after_keep_equals_a_plain_runs_state(loaded):
    """For every verify width 1..16 and every kept count a: after keep(seq, a) every GDN layer's
    conv tail and delta state equal those of a sequence fed only the kept rows one at a time
    (bitwise when batch-invariant)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.vocab_size, (11,), generator=g).tolist()
    rows = torch.randint(0, loaded.vocab_size, (16,), generator=g).tolist()
    plain, plain_states = loaded.new_sequence(), []
    for t in prompt:
        forward_one(loaded, plain, [t], logits="none")
    for t in [None, *rows]:  # the plain state after prompt + rows[:a], a = 0..16
        if t is not None:
            forward_one(loaded, plain, [t], logits="none")
        plain_states.append(_recurrent_values(loaded, plain))
    loaded.release(plain)
    for width in range(1, 17):
        for kept in range(width + 1):
            seq = loaded.new_sequence()
            forward_one(loaded, seq, prompt, logits="none")
            forward_one(loaded, seq, rows[:width], logits="none", verify=True)
            loaded.keep(seq, kept)
            got = _recurrent_values(loaded, seq)
            assert len(got) == 3
            for layer, (a, b) in enumerate(zip(got, plain_states[kept])):
                for name in ("conv", "ssm"):
                    if declared(loaded, "spec_batch_invariant"):
                        assert torch.equal(a[name], b[name]), f"kept {kept}/{width}, GDN layer {layer} {name}"
                    else:
                        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-4)
            loaded.release(seq)


def test_truncate_refuses_a_prefix_but_empties(loaded):
    seq = loaded.new_sequence()
    first = forward_one(loaded, seq, [3, 4, 5], logits="last").logits
    forward_one(loaded, seq, [9, 9], logits="none")
    with pytest.raises(CannotTruncate, match="recurrent"):
        loaded.truncate(seq, 3)
    assert loaded.seq_len(seq) == 5
    loaded.truncate(seq, 0)
    assert torch.equal(forward_one(loaded, seq, [3, 4, 5], logits="last").logits, first)


def test_keep_inside_a_verify_split_across_forward_chunks(tiny_fixture):
    """A verify longer than the forward chunk arrives at the state in pieces; keep(a) still picks
    row a's state (bitwise: int8) for a on either side of the chunk boundary."""
    _, _, path = tiny_fixture("dense_conf")
    trunk = load(path, dtype="int8", max_rows_per_forward=5)
    prompt, rows = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]
    for kept in (0, 3, 5, 6, 12):
        seq, plain = trunk.new_sequence(), trunk.new_sequence()
        forward_one(trunk, seq, prompt, logits="none")
        forward_one(trunk, seq, rows, logits="none", verify=True)
        trunk.keep(seq, kept)
        forward_one(trunk, plain, prompt + rows[:kept], logits="none")
        for a, b in zip(_recurrent_values(trunk, seq), _recurrent_values(trunk, plain)):
            assert all(torch.equal(a[name], b[name]) for name in ("conv", "ssm")), f"kept {kept}"
        nxt = [forward_one(trunk, s, [7]).logits for s in (seq, plain)]
        assert torch.equal(nxt[0], nxt[1])
