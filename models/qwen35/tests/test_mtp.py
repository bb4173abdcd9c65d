"""The MTP draft head (verispec.testing.NextNHeadSuite) on the dense and the MoE fixture: its steps
against an independent reference built from transformers' modules (`tiny_qwen35.HfMtpReference`),
its per-sequence KV through commits, keeps and gaps, exact streams under the `mtp` speculator
(when verispec-mtp-nextn is installed) and a short training; then a standalone MTP file."""
import pytest
import torch
from tiny_qwen35 import TINY_CONFIGS, HfMtpReference, write_fixture
from verispec.testing import NextNCase, NextNHeadSuite, NextNTraining
from verispec_qwen35.loader import load

pytest.importorskip("transformers")


class TestQwen35MtpHead(NextNHeadSuite):
    @pytest.fixture(scope="class", params=["dense_mtp", "moe_fused_mtp"])
    @classmethod
    def name(cls, request):
        return request.param

    @pytest.fixture(scope="class")
    @classmethod
    def nextn_case(cls, tiny_fixture, name):
        hf_model, mtp, path = tiny_fixture(name)
        reference = HfMtpReference(hf_model, mtp).eval()
        tokens = torch.randint(0, hf_model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            hidden = hf_model(tokens[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed [n, D]
        return NextNCase(load(path, dtype="float32").draft_head, reference, tokens, hidden)

    @pytest.fixture(scope="class")
    @classmethod
    def nextn_trunk(cls, tiny_fixture, name):
        path = tiny_fixture(name)[2]
        return lambda dtype: load(path, dtype=dtype)

    @pytest.fixture
    def nextn_training(self, tiny_fixture):
        hf_model, mtp, path = tiny_fixture("dense_mtp")
        for p in hf_model.parameters():
            p.requires_grad_(False)  # only the head trains
        reference = HfMtpReference(hf_model, mtp)  # a trainable copy of the block: the fixture's stays
        return NextNTraining(trunk=load(path, dtype="float32"), block=reference, reference=reference,
                             write=lambda out: write_fixture(hf_model, out, mtp=reference.mtp_state_dict(),
                                                             options=TINY_CONFIGS["dense_mtp"][3]),
                             load=lambda out: load(out, dtype="float32"))


def test_no_mtp_block_no_head(tiny_fixture):
    _, _, path = tiny_fixture("dense")
    assert load(path, dtype="float32").draft_head is None


# -- a standalone MTP GGUF paired with a main file without one (docs/reference/qwen35.md §3.7, variant 3) --

def _split_files(tiny_fixture, tmp_path, name="dense_mtp"):
    """(main GGUF without the MTP block, the MTP-only GGUF, the combined GGUF) of one model."""
    from tiny_qwen35 import hf_to_gguf

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


@pytest.mark.parametrize("value, counts", [(float("nan"), "1 NaN of"), (float("-inf"), "1 inf of")])
def test_a_standalone_mtp_file_with_non_finite_weights_is_refused(tiny_fixture, tmp_path, value, counts):
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values
    from verispec_qwen35.loader import load_mtp_file

    main, mtp_only, _ = _split_files(tiny_fixture, tmp_path)
    trunk = load(main, dtype="float32", use_cache=False)
    name = f"blk.{trunk.config.num_hidden_layers}.nextn.eh_proj.weight"
    bad = plant_values(mtp_only, tmp_path / "bad-mtp.gguf", name, [value])
    with pytest.raises(DamagedFile) as info:
        load_mtp_file(bad, trunk, use_cache=False)
    message = str(info.value)
    assert message.startswith(f"{bad}: tensor '{name}' holds {counts} ") and "train it again" in message


def test_a_main_files_mtp_block_with_non_finite_weights_is_refused_and_the_trunks_own_are_not(tiny_fixture, tmp_path):
    """The MTP block inside a main file is a draft head: a NaN there is named at load (it would draft
    junk without a word); a NaN in the trunk's own layers loads (check_weights names it when a
    forward's logits go bad), as it always has."""
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values

    _, _, combined = _split_files(tiny_fixture, tmp_path)
    n = load(combined, dtype="float32", use_cache=False).config.num_hidden_layers
    head = f"blk.{n}.nextn.eh_proj.weight"
    bad = plant_values(combined, tmp_path / "bad-head.gguf", head, [float("nan")])
    with pytest.raises(DamagedFile) as info:
        load(bad, dtype="float32", use_cache=False)
    assert str(info.value).startswith(f"{bad}: tensor '{head}' holds 1 NaN of ")
    trunk_bad = plant_values(combined, tmp_path / "bad-trunk.gguf", "blk.0.ffn_up.weight", [float("nan")])
    assert load(trunk_bad, dtype="float32", use_cache=False).config.num_mtp_layers == 1
