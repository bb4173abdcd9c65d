"""Through the loop and the engine on tiny trunks of two families (llama, Gemma 3): the trunks serve the
drafter's taps (= the reference's `extract_context_feature` of transformers' hidden states: the +1
convention end to end), and every stream equals plain greedy with a random drafter (drafts mostly
rejected: rollbacks at every depth) and with a perfect-copy drafter (acceptance 1.0). A llama trunk
with block-quantised linears serves the taps from its fused C decoder layers, bitwise the op-by-op ones.

The perfect-copy pair: a trunk whose layers write nothing to the residual (attention and FFN
output projections zero) and whose embedding rows share one direction e0 (token c's row 3·e0), so
its greedy continuation is c forever (verispec.testing.make_copy_model); the drafter's sublayer outputs are zero too, so its block
rows are the mask's embedding ≈ e0 and it drafts c with confidence ≈ 1. Degenerate models, but
every pass of the real code runs (taps, Pass A/B rings, Pass C, readout, gate, keep/commit).
"""
from __future__ import annotations

import pytest
import torch
from tiny_dflash import MASK_ID, TARGET, build_target, make_drafter

pytest.importorskip("dflash.model", reason="the reference oracle: pip install --no-deps dflash==0.1.0")

from verispec.seams import Segment  # noqa: E402
from verispec.testing import (assert_second_turn_streams_plain, assert_staggered_streams_plain,  # noqa: E402
                              make_copy_model, run_greedy)
from verispec.testing.fixture_writer import byte_level_vocab  # noqa: E402
from verispec_dflash.gguf_writer import write_dflash_gguf  # noqa: E402
from verispec_dflash.loader import load  # noqa: E402
from verispec_dflash.speculator import BlockSpeculator  # noqa: E402

FAMILIES = ("llama", "gemma3")
HF_TAPS = {"llama": (0, 2), "gemma3": (1, 3, 5)}  # Gemma 3's 7 layers: taps on sliding and full layers
PROMPTS = ([5, 17, 33, 2, 90, 41, 41, 8], [60, 61, 62, 7], [12] * 11 + [99, 3])
COPY_TOKEN = 77


FAMILY_PACKAGES = {"llama": ("verispec_llama", "models/llama"), "gemma3": ("verispec_gemma4", "models/gemma4")}


def _needs_family(family):
    module, path = FAMILY_PACKAGES[family]
    pytest.importorskip(module, reason=f"the {family} test trunk's family: pip install -e {path}")


def _hf_target(family, *, copy=False):
    _needs_family(family)
    if family == "llama":
        model = build_target()
    else:
        from tiny_gemma import make_hf_gemma3

        model = make_hf_gemma3()
    if copy:
        make_copy_model(model, COPY_TOKEN)
    return model


def _write_trunk(family, model, path):
    if family == "llama":
        from tiny_llama import write_fixture

        return write_fixture(model, path)
    from tiny_gemma import write_gemma3_gguf

    return write_gemma3_gguf(path, model)


def _load_trunk(family, path, dtype="float32"):
    if family == "llama":
        from verispec_llama.loader import load as load_llama

        return load_llama(path, dtype=dtype)
    from verispec_gemma4.loader import load as load_gemma

    return load_gemma(path, dtype=dtype)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(family, copy=False) -> (hf target, trunk path, reference drafter, drafter path), built once each."""
    made, directory = {}, tmp_path_factory.mktemp("pairs")

    def _get(family, copy=False):
        if (family, copy) not in made:
            hf = _hf_target(family, copy=copy)
            trunk_path = _write_trunk(family, hf, directory / f"{family}-{copy}.gguf")
            if copy:  # no softcap (it would squash the margin) and P = 0 (random codebooks would outvote it)
                variant = "d2_noncausal" if family == "gemma3" else "d1_noncausal"
                ref = make_drafter(variant, hf_taps=HF_TAPS[family], seed=3, zero_selector=True)
            else:
                ref = make_drafter("d2_noncausal_window" if family == "gemma3" else "d1_noncausal",
                                   hf_taps=HF_TAPS[family], seed=3)
            if copy:
                with torch.no_grad():
                    for name, p in ref.named_parameters():
                        if name.endswith(("o_proj.weight", "down_proj.weight")):
                            p.zero_()
                        elif name == "norm.weight":
                            p.fill_(1.0)
            path = write_dflash_gguf(directory / f"drafter-{family}-{copy}.gguf", ref,
                                     vocab=byte_level_vocab(TARGET["vocab_size"]))
            made[family, copy] = hf, trunk_path, ref, path
        return made[family, copy]

    return _get


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_taps_are_the_reference_features(pair, family):
    from dflash.model import extract_context_feature

    hf, trunk_path, ref, drafter_path = pair(family)
    trunk = _load_trunk(family, trunk_path)
    head = load(drafter_path, trunk)
    tokens = PROMPTS[0]
    seq = trunk.new_sequence()
    out = trunk.forward([Segment(seq, tokens[:5], hidden=True, tap_layers=head.tap_layers),
                         ])[0].hidden
    more = trunk.forward([Segment(seq, tokens[5:], hidden=True, tap_layers=head.tap_layers)])[0].hidden
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = extract_context_feature(states, ref.target_layer_ids)[0]
    torch.testing.assert_close(torch.cat([out, more]), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_streams_equal_plain_greedy(pair, family, dtype):
    _, trunk_path, _, drafter_path = pair(family)
    trunk = _load_trunk(family, trunk_path, dtype)
    head = load(drafter_path, trunk)
    speculator = BlockSpeculator(head, max_draft_tokens=5, min_draft_prob=0.0)
    # staggered: solo speculative steps, batched steps (the head sees batched decode rows), solo again
    assert_staggered_streams_plain(trunk, speculator, PROMPTS, (48, 24, 12), submit_at=(0, 6, 9), max_draft_tokens=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_perfect_copy_drafter_is_accepted_in_full(pair, family):
    _, trunk_path, _, drafter_path = pair(family, copy=True)
    trunk = _load_trunk(family, trunk_path)
    head = load(drafter_path, trunk)
    plain = run_greedy(trunk, list(PROMPTS[0]), 40)[0]
    assert plain == [COPY_TOKEN] * 40  # the construction works (else the test below proves nothing)
    speculator = BlockSpeculator(head, max_draft_tokens=8)  # the default gate (0.35) passes: confidence ≈ 1
    got, ex = run_greedy(trunk, list(PROMPTS[0]), 40, speculator, max_draft_tokens=8)
    assert got == plain
    assert ex.stats.num_draft_tokens >= 30 and ex.stats.num_accepted_tokens == ex.stats.num_draft_tokens


@pytest.mark.parametrize("spec_type", ["block", "auto"])
def test_draft_model_flag_through_the_engine(pair, spec_type):
    import verispec

    _, trunk_path, _, drafter_path = pair("llama")
    prompt = list(PROMPTS[0])
    plain = verispec.load(trunk_path, dtype="float32", enabled=False)
    want = [e.token for e in plain.generate(prompt, max_tokens=24, ignore_eos=True)]
    engine = verispec.load(trunk_path, dtype="float32", spec_type=spec_type, draft_model=drafter_path,
                           adaptive=False, min_draft_prob=0.0)
    generation = engine.generate(prompt, max_tokens=24, ignore_eos=True)
    assert [e.token for e in generation] == want
    assert generation.result.speculator == "dflash"
    assert generation.result.spec.num_draft_tokens > 0


def test_second_turn_after_prefix_reuse_streams_plain_greedy(pair):
    """can_arm_after_prefix_reuse: the reused rows reach the head without taps (a gap in its ring);
    it drafts from the next committed rows on, and the stream stays the plain one."""
    _, trunk_path, _, drafter_path = pair("llama")
    trunk = _load_trunk("llama", trunk_path)
    speculator = BlockSpeculator(load(drafter_path, trunk), max_draft_tokens=4, min_draft_prob=0.0)
    assert_second_turn_streams_plain(trunk, speculator, PROMPTS[0], max_draft_tokens=4)


def test_taps_through_fused_decoder_layers(tmp_path):
    """A llama trunk with block-quantised linears in the `gguf` weight mode runs each decoder layer as
    one C call (verispec.nn.layers): its taps equal the op-by-op layers' bitwise, and a random
    drafter's streams stay plain greedy."""
    _needs_family("llama")
    from tiny_llama import hf_to_gguf
    from verispec.kernels import ckernels
    from verispec.testing.fixture_writer import write_gguf
    from verispec_llama.loader import load as load_llama

    if ckernels.library() is None:
        pytest.skip("no C compiler: the kernels are not built")
    hf = build_target(hidden_size=96, intermediate_size=64)  # widths multiples of a 32-block
    arch, metadata, tensors = hf_to_gguf(hf)
    types = {n: "Q8_0" for n in tensors if n.startswith("blk.") and n.split(".")[2] in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    trunk_path = write_gguf(tmp_path / "q8.gguf", arch=arch, metadata=metadata, tensors=tensors, tensor_types=types)
    ref = make_drafter("d1_causal_window", hf_taps=(0, 2), hidden_size=96, seed=4)
    drafter_path = write_dflash_gguf(tmp_path / "d.gguf", ref, vocab=byte_level_vocab(TARGET["vocab_size"]))
    trunk = load_llama(trunk_path, dtype="gguf")
    head = load(drafter_path, trunk)

    def taps():
        seq = trunk.new_sequence()
        out = trunk.forward([Segment(seq, list(PROMPTS[0]), hidden=True, tap_layers=head.tap_layers)])[0].hidden
        trunk.release(seq)
        return out

    fused = taps()
    assert all(layer._kernel is not None for layer in trunk.model.layers)  # the fused path ran
    for layer in trunk.model.layers:
        layer.fused = False
    assert torch.equal(fused, taps())
    for layer in trunk.model.layers:
        layer.fused = True
    want = run_greedy(trunk, list(PROMPTS[2]), 32)[0]
    got, ex = run_greedy(trunk, list(PROMPTS[2]), 32, BlockSpeculator(head, max_draft_tokens=4, min_draft_prob=0.0),
                         max_draft_tokens=4)
    assert got == want and ex.stats.num_draft_tokens > 0
