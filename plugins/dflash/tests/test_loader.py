"""The loader: the mainline schema read back (+1 taps, generation), and every refusal naming its reason
(reference note §5.4, §8 test 8): other schemas, partial DFlash2, unknown and unsupported tensors,
missing keys, and the binding checks against the trunk (hidden size, taps, fc width, tokenizer,
mask id, selector vocabulary, H >= K(K+1))."""
from __future__ import annotations

import pytest
import torch
from tiny_dflash import MASK_ID, TARGET

pytest.importorskip("dflash.model", reason="the reference oracle: pip install --no-deps dflash==0.1.0")

from verispec.errors import UnsupportedArchitecture, VerispecError  # noqa: E402
from verispec.gguf.io import GGUFFile, MissingKey  # noqa: E402
from verispec.seams import DrafterMismatch, DraftHeadKind  # noqa: E402
from verispec.testing.fixture_writer import byte_level_vocab  # noqa: E402
from verispec_dflash.errors import MalformedDFlash, NotADFlashDrafter, UnsupportedDFlash  # noqa: E402
from verispec_dflash.gguf_writer import write_dflash_gguf  # noqa: E402
from verispec_dflash.loader import load  # noqa: E402

VOCAB = byte_level_vocab(TARGET["vocab_size"])


def _variant(tmp_path, model, name="variant", **kwargs):
    kwargs.setdefault("vocab", VOCAB)
    return write_dflash_gguf(tmp_path / f"{name}.gguf", model, **kwargs)


def test_taps_are_written_plus_one_and_read_as_entering_layers(target, drafter_file):
    _, _, trunk = target
    ref, path = drafter_file("d1_noncausal")
    assert list(GGUFFile.open(path).metadata["dflash.target_layers"]) == [t + 1 for t in ref.target_layer_ids]
    head = load(path, trunk)
    assert head.draft_head_kind is DraftHeadKind.BLOCK
    assert head.tap_layers == tuple(t + 1 for t in ref.target_layer_ids)
    assert head.draft_block_size == ref.block_size and head.config.mask_token_id == MASK_ID
    assert head.feature_size == len(head.tap_layers) * TARGET["hidden_size"]


def test_generation_is_told_by_tensors(target, drafter_file):
    _, _, trunk = target
    assert load(drafter_file("d1_noncausal")[1], trunk).config.generation == 1
    config = load(drafter_file("d2_noncausal")[1], trunk).config
    assert (config.generation, config.conv_kernel_size, config.conv_group_size) == (2, 3, 4)
    assert (config.selector_rank, config.selector_top_k, config.selector_vocab_size) == (6, 4, TARGET["vocab_size"])


@pytest.mark.parametrize("drop, named", [
    (("selector_hidden.weight",), "selector_hidden.weight"),
    (("blk.1.ffn_conv_base",), "blk.1.ffn_conv_base"),
])
def test_partial_dflash2_is_refused_by_name(tmp_path, target, drafter_file, drop, named):
    ref, _ = drafter_file("d2_noncausal")
    with pytest.raises(MalformedDFlash, match=f"DFlash2 file missing {named}"):
        load(_variant(tmp_path, ref, drop=drop), target[2])


def test_dflash2_keys_without_tensors_are_refused(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    with pytest.raises(MalformedDFlash, match="DFlash2 file missing blk.0.attn_conv_base"):
        load(_variant(tmp_path, ref, extra_metadata={"dflash.selector_rank": 6}), target[2])


@pytest.mark.parametrize("extra", [
    {"extra_metadata": {"dflash.sample_from_anchor": True}},
    {"extra_metadata": {"dflash.hc_mult": 4}},
    {"extra_tensors": {"markov_w1.weight": torch.zeros(TARGET["vocab_size"], 8)}},
])
def test_other_schemas_are_not_dflash(tmp_path, target, drafter_file, extra):
    ref, _ = drafter_file("d1_noncausal")
    with pytest.raises(NotADFlashDrafter, match="not a DFlash drafter"):
        load(_variant(tmp_path, ref, **extra), target[2])


@pytest.mark.parametrize("name, shape, reason", [
    ("blk.0.extra_gate.weight", (4, 48), "tensors the DFlash math does not read"),
    ("blk.0.attn_q.bias", (40,), "attention biases"),
    ("d2t", (131,), "reduced draft vocabulary"),
    ("token_embd.weight", (131, 48), "draft-owned embedding"),
])
def test_unknown_and_unsupported_tensors_are_refused(tmp_path, target, drafter_file, name, shape, reason):
    ref, _ = drafter_file("d1_noncausal")
    with pytest.raises(UnsupportedDFlash, match=reason):
        load(_variant(tmp_path, ref, extra_tensors={name: torch.zeros(shape)}), target[2])


@pytest.mark.parametrize("key, error", [
    ("dflash.block_size", MissingKey), ("dflash.target_layers", MissingKey),
    ("tokenizer.ggml.mask_token_id", MalformedDFlash),
])
def test_required_keys(tmp_path, target, drafter_file, key, error):
    ref, _ = drafter_file("d1_noncausal")
    with pytest.raises(error):
        load(_variant(tmp_path, ref, extra_metadata={key: None}), target[2])


def test_legacy_mask_key_is_read(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    path = _variant(tmp_path, ref, extra_metadata={"tokenizer.ggml.mask_token_id": None, "dflash.mask_token_id": 129})
    assert load(path, target[2]).config.mask_token_id == 129


@pytest.mark.parametrize("extra, match", [
    ({"dflash.attention.sliding_window": 4}, "block size 6 exceeds the sliding window 4"),
    ({"dflash.attention.causal": None}, "mixed without dflash.attention.causal"),
    ({"dflash.attention.sliding_window_pattern": [True]}, "1 entries for 2 layers"),
    ({"dflash.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn'"),
])
def test_inconsistent_or_unsupported_keys(tmp_path, target, drafter_file, extra, match):
    ref, _ = drafter_file("d1_noncausal_window_mixed")
    with pytest.raises(VerispecError, match=match):
        load(_variant(tmp_path, ref, extra_metadata=extra), target[2])


def test_selector_needs_hidden_at_least_k_k_plus_1(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d2_noncausal")
    with pytest.raises(MalformedDFlash, match=r"K\(K\+1\) = 56"):
        load(_variant(tmp_path, ref, extra_metadata={"dflash.selector_top_k": 7}), target[2])


# -- binding against the trunk ----------------------------------------------------------------

def _mismatch(path, trunk, *phrases):
    with pytest.raises(DrafterMismatch) as info:
        load(path, trunk)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, message
    assert "pass a DFlash drafter made for this model as --draft-model" in message  # the fix


def test_taps_past_the_trunk_are_refused(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    _mismatch(_variant(tmp_path, ref, "deep", extra_metadata={"dflash.target_layers": [1, 9]}), target[2],
              "taps target layers [1, 9]", "layers 0..3")
    _mismatch(_variant(tmp_path, ref, "last", extra_metadata={"dflash.target_layers": [1, 4]}), target[2],
              "tap 4 = after the last layer")


def test_fc_width_and_hidden_size_must_fit_the_trunk(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    three_taps = _variant(tmp_path, ref, "taps3", extra_metadata={"dflash.target_layers": [1, 2, 3]})
    _mismatch(three_taps, target[2], "fc.weight reads 3 taps of 32 (width 96)", "(3 taps = 144)")
    five_taps = _variant(tmp_path, ref, "taps5", extra_metadata={"dflash.target_layers": [0, 1, 2, 3, 3]})
    with pytest.raises(MalformedDFlash, match="does not take 5 concatenated taps"):
        load(five_taps, target[2])
    narrow = _variant(tmp_path, ref, "narrow", extra_tensors={"fc.weight": torch.zeros(48, 2 * 40)})
    _mismatch(narrow, target[2], "fc.weight reads 2 taps of 40", "rows are 48 wide")
    small_ref, _ = drafter_file("d1_noncausal", hidden_size=40)  # reads 48-wide taps, works 40 wide
    small = _variant(tmp_path, small_ref, "small_hidden", extra_tensors={"fc.weight": torch.zeros(40, 2 * 48)})
    _mismatch(small, target[2], "the drafter's hidden size is 40, the trunk's 48")


def test_another_tokenizer_is_refused(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    tokens = list(VOCAB["tokenizer.ggml.tokens"])
    tokens[50] = "zz"
    _mismatch(_variant(tmp_path, ref, vocab={**VOCAB, "tokenizer.ggml.tokens": tokens}), target[2],
              "drafter built for another tokenizer", "first difference at id 50")
    _mismatch(_variant(tmp_path, ref, "novocab", vocab=None), target[2], "carries no tokenizer")


def test_mask_id_past_the_head_is_refused(tmp_path, target, drafter_file):
    ref, _ = drafter_file("d1_noncausal")
    _mismatch(_variant(tmp_path, ref, extra_metadata={"tokenizer.ggml.mask_token_id": 131}), target[2],
              "mask id 131 is past the target head's 131 rows")


def test_not_a_dflash_file(target):
    _, path, trunk = target
    with pytest.raises(UnsupportedArchitecture, match="'llama' GGUF"):
        load(path, trunk)


def test_registered_as_a_drafter_file_and_a_speculator():
    from verispec.registry import Registry
    from verispec.specs import DraftFileSpec

    registry = Registry.discover()
    spec = registry.drafter_for_architecture("dflash")
    assert isinstance(spec, DraftFileSpec) and spec.loader == "verispec_dflash.loader:load"
    speculator = registry.speculators["dflash"].spec
    assert speculator.requires_draft_head and speculator.needs_hidden_state
    assert speculator.default_min_draft_prob == 0.35 and speculator.can_arm_after_prefix_reuse


def test_a_quantised_file_runs_its_linears_on_its_own_blocks(tmp_path, target, drafter_file):
    """Q8_0 linears become BlockLinears over the stored blocks (activations rounded to int8 per 32
    columns): the block rows stay within that rounding of the same values multiplied in fp32."""
    from verispec.weights.block_linear import BlockLinear

    _, _, trunk = target
    ref, f32_path = drafter_file("d1_noncausal")
    path = _variant(tmp_path, ref, name="q8", quantize="Q8_0")
    head, dequantised = load(path, trunk), load(path, trunk, block_kernel=False)
    assert head.drafter.linears and all(isinstance(m, BlockLinear) for m in head.drafter.linears.values())
    assert "fc.weight" in head.drafter.linears  # T·H = 96 columns: whole blocks
    assert not dequantised.drafter.linears and not load(f32_path, trunk).drafter.linears
    features = torch.randn(20, head.feature_size, generator=torch.Generator().manual_seed(6))
    a, b = head.new_state(), dequantised.new_state()
    head.draft_catch_up(a, [0] * 20, features, 0)
    dequantised.draft_catch_up(b, [0] * 20, features, 0)
    z, z_fp32 = head.block_logits(a, 3, 20)[0], dequantised.block_logits(b, 3, 20)[0]
    assert not torch.equal(z, z_fp32)  # the block kernel ran
    torch.testing.assert_close(z, z_fp32, atol=0.05 * float(z_fp32.abs().max()), rtol=0)


@pytest.mark.parametrize("values, counts", [([float("nan")], "1 NaN of 1,392 values"),
                                            ([float("inf"), 1.0, float("-inf")], "2 inf of 1,392 values")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, target, drafter_file, values, counts):
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values

    _, path = drafter_file("d1_noncausal")
    bad = plant_values(path, tmp_path / "bad.gguf", "blk.1.ffn_down.weight", values)
    with pytest.raises(DamagedFile) as info:
        load(bad, target[2])
    message = str(info.value)
    assert message.startswith(f"{bad}: tensor 'blk.1.ffn_down.weight' holds {counts}; ")
    assert "convert the drafter again" in message and "train it again" in message and "\n" not in message
