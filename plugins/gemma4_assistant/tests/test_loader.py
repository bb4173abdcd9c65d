"""The assistant GGUF loader: every architecture spelling, the binding checks naming the
mismatch and the fix, files holding tensors the math does not read, the registry entries."""
import pytest
import torch
from tiny_assistant import DENSE_TARGET, E_TARGET, make_hf_assistant, write_assistant_gguf
from tiny_gemma import make_hf_gemma4, write_gemma4_gguf
from verispec.errors import UnusedTensors, VerispecError
from verispec.seams import DraftHead, DraftHeadKind, DrafterMismatch
from verispec_gemma4.loader import load as load_trunk
from verispec_gemma4_assistant.head import Gemma4AssistantHead
from verispec_gemma4_assistant.loader import load


def _trunk(path):
    return load_trunk(path, dtype="float32", use_cache=False, tokenizer=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_hf_gemma4(DENSE_TARGET)
    assistant = make_hf_assistant(target, centroids=False)
    directory = tmp_path_factory.mktemp("loader")
    return target, assistant, _trunk(write_gemma4_gguf(directory / "trunk.gguf", target)), directory


@pytest.mark.parametrize("arch", ["gemma4-assistant", "gemma4_assistant", "gemma4_mtp"])
def test_every_spelling_loads_the_same_head(pair, arch):
    target, assistant, trunk, directory = pair
    head = load(write_assistant_gguf(directory / f"{arch}.gguf", assistant, target, arch=arch), trunk,
                use_cache=False)
    assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
    assert head.draft_head_resumes_after_gap and head.new_state().seq is None
    assert head.kv_layers == {"sliding_attention": 4, "full_attention": 5}  # the last layer of each type
    reference = load(write_assistant_gguf(directory / "ref.gguf", assistant, target), trunk, use_cache=False)
    assert torch.equal(head.model.pre_projection.weight, reference.model.pre_projection.weight)


def test_earlier_nextn_tensor_names_load(pair):
    target, assistant, trunk, directory = pair
    state = assistant.state_dict()
    path = write_assistant_gguf(directory / "nextn.gguf", assistant, target,
                                drop=("mtp_pre_proj.weight", "mtp_post_proj.weight"),
                                extra_tensors={"nextn_pre_proj.weight": state["pre_projection.weight"],
                                               "nextn_post_proj.weight": state["post_projection.weight"]})
    head = load(path, trunk, use_cache=False)
    torch.testing.assert_close(head.model.post_projection.weight, state["post_projection.weight"])


def test_a_file_with_kv_projections_is_another_variant(pair):
    target, assistant, trunk, directory = pair
    path = write_assistant_gguf(directory / "kv.gguf", assistant, target,
                                extra_tensors={"blk.0.attn_k.weight": torch.zeros(32, 24)})
    with pytest.raises(UnusedTensors, match="blk.0.attn_k.weight"):
        load(path, trunk, use_cache=False)


@pytest.mark.parametrize("metadata, match", [
    ({"gemma4-assistant.embedding_length_out": 48}, r"reads 48-wide trunk rows \(embedding_length_out\), the "
                                                    r"trunk's hidden size is 40; pass the assistant released"),
    ({"gemma4-assistant.attention.key_length_swa": 8}, "head dim 8, the trunk's sliding layers 16"),
    ({"gemma4-assistant.attention.head_count_kv": 2}, "over 2 KV heads, the trunk's full layer 5 has 1"),
    ({"gemma4-assistant.attention.sliding_window": 100}, "see 101 positions and the trunk's sliding-window ring"),
])
def test_binding_checks_name_the_mismatch_and_the_fix(pair, metadata, match):
    target, assistant, trunk, directory = pair
    path = write_assistant_gguf(directory / "bad.gguf", assistant, target, extra_metadata=metadata)
    with pytest.raises(DrafterMismatch, match=match) as info:
        load(path, trunk, use_cache=False)
    assert isinstance(info.value, VerispecError) and str(path) in str(info.value)


def test_another_vocabulary_or_family_is_refused(pair, tmp_path):
    target, assistant, trunk, directory = pair
    other = make_hf_gemma4(E_TARGET)  # 128 ids, hidden 48
    other_assistant = make_hf_assistant(other, centroids=True)
    wide = make_hf_gemma4({**DENSE_TARGET, "vocab_size": 128})
    with pytest.raises(DrafterMismatch, match="vocabulary has 128 ids, the trunk's 131"):
        load(write_assistant_gguf(tmp_path / "v.gguf", make_hf_assistant(wide, centroids=False), wide), trunk)
    with pytest.raises(DrafterMismatch, match="embedding_length_out"):
        load(write_assistant_gguf(tmp_path / "e.gguf", other_assistant, other), trunk)
    from tiny_gemma import make_hf_gemma3, write_gemma3_gguf

    gemma3 = load_trunk(write_gemma3_gguf(tmp_path / "g3.gguf", make_hf_gemma3()), dtype="float32",
                        use_cache=False, tokenizer=False)
    with pytest.raises(DrafterMismatch, match="drafts for a Gemma 4 trunk, and the model is Gemma3ForCausalLM"):
        load(write_assistant_gguf(tmp_path / "a.gguf", assistant, target), gemma3)


def test_a_dense_only_file_refuses_the_centroid_head(pair):
    target, assistant, trunk, directory = pair
    with pytest.raises(ValueError, match="no centroid head"):
        load(write_assistant_gguf(directory / "dense.gguf", assistant, target), trunk, centroids=True)


def test_registered_as_drafter_file_and_speculator():
    from verispec.registry import Registry
    from verispec.specs import resolve

    registry = Registry.discover()
    for arch in ("gemma4-assistant", "gemma4_assistant", "gemma4_mtp"):
        assert resolve(registry.drafter_for_architecture(arch).loader) is load
    spec = registry.speculators["gemma4-assistant"].spec
    assert spec.requires_draft_head and spec.needs_hidden_state and spec.can_arm_after_prefix_reuse
    assert spec.priority > registry.speculators["mtp"].spec.priority if "mtp" in registry.speculators else True
    assert resolve(spec.factory)(None, spec=spec, max_draft_tokens=3, min_draft_prob=0.1, draft_head=None) is None
    assert Gemma4AssistantHead.draft_head_resumes_after_gap


@pytest.mark.parametrize("values, counts", [([float("nan")], "1 NaN of"), ([float("inf")], "1 inf of")])
def test_non_finite_weights_are_refused_naming_the_tensor(pair, values, counts):
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values

    target, assistant, trunk, directory = pair
    good = write_assistant_gguf(directory / "finite.gguf", assistant, target)
    bad = plant_values(good, directory / "bad.gguf", "blk.0.ffn_down.weight", values)
    with pytest.raises(DamagedFile) as info:
        load(bad, trunk, use_cache=False)
    message = str(info.value)
    assert message.startswith(f"{bad}: tensor 'blk.0.ffn_down.weight' holds {counts} ")
    assert "train it again" in message and "\n" not in message
