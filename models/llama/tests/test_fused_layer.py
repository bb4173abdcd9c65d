"""The fused decoder layer (verispec.nn.layers, layers.c) gives the op-by-op forward's bits: a
tiny llama and qwen2 written with quantised linears of several GGUF types (so q|k|v runs
partwise), in the `gguf` weight mode, prefill (chunked), decodes, verifies and two sequences
in one forward, with the fused path checked to have run."""
import pytest
import torch
from tiny_llama import build_hf_model, hf_to_gguf
from verispec.kernels import ckernels
from verispec.testing import forward_one
from verispec.testing.gguf_weights import assert_fused_layers_are_op_by_op
from verispec.testing.fixture_writer import write_gguf
from verispec_llama.loader import load

pytestmark = pytest.mark.skipif(ckernels.library() is None, reason="no C compiler: the kernels are not built")

#: ggml type per GGUF linear: mixed across q|k|v (two runs) and the MLP
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
CONFIGS = {  # linear widths multiples of 32 (a block)
    "llama_blocks": ("llama", {"vocab_size": 131, "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": False}),
    "qwen2_blocks": ("qwen2", {"vocab_size": 139, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trunk(request, tmp_path_factory, monkeypatch_module):
    import tiny_llama

    monkeypatch_module.setitem(tiny_llama.TINY_CONFIGS, request.param, CONFIGS[request.param])
    arch, metadata, tensors = hf_to_gguf(build_hf_model(request.param))
    types = {name: TYPES[name.split(".")[2]] for name in tensors
             if name.startswith("blk.") and name.endswith(".weight") and name.split(".")[2] in TYPES}
    path = write_gguf(tmp_path_factory.mktemp("fused") / "q.gguf", arch=arch, metadata=metadata, tensors=tensors,
                      tensor_types=types)
    return load(path, dtype="gguf")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_fused_layer_is_the_op_by_op_layer_bitwise(trunk):
    ids = torch.randint(0, trunk.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_fused_layers_are_op_by_op(trunk, ids, prefill=70)  # 64 + 6 rows: two chunks


def test_two_sequences_in_one_forward_are_each_alone(trunk):
    """A batched decode of two sequences through the fused layers gives each sequence's own bits."""
    from verispec.seams import Segment

    ids = [5, 17, 3, 44, 9, 12, 30]
    seqs = [trunk.new_sequence() for _ in range(2)]
    for s, start in zip(seqs, (0, 2)):
        forward_one(trunk, s, ids[start:start + 4], logits="last")
    both = trunk.forward([Segment(seqs[0], [ids[4]]), Segment(seqs[1], [ids[6]])])
    alone = []
    for s, start, tok in zip(seqs, (0, 2), (ids[4], ids[6])):
        trunk.truncate(s, 4)
        alone.append(forward_one(trunk, s, [tok]).logits)
    for out, ref in zip(both, alone):
        assert torch.equal(out.logits, ref)
    for s in seqs:
        trunk.release(s)



def test_a_replaced_weight_rebuilds_the_fused_kernel(trunk):
    """The cached kernel points at packed tensors: replacing one, or a linear module, makes the
    next forward build a new kernel over the new weights, never read the old ones."""
    import copy

    layer = trunk.model.layers[0]
    attn, o_proj = layer.self_attn, layer.self_attn.o_proj

    def logits():
        seq = trunk.new_sequence()
        out = forward_one(trunk, seq, [5, 17, 3, 44], logits="last").logits
        trunk.release(seq)
        return out

    before = logits()
    kernel = layer._kernel
    assert kernel is not None and torch.equal(logits(), before) and layer._kernel is kernel  # reused
    packed = o_proj.packed
    try:
        o_proj.packed = torch.zeros_like(packed)  # every o weight's u = 0
        changed = logits()
        assert layer._kernel is not kernel and not torch.equal(changed, before)
        layer.fused = False
        assert torch.equal(logits(), changed)  # the op-by-op forward reads the same new weights
        layer.fused = True
        o_proj.packed = packed
        attn.o_proj = copy.deepcopy(o_proj)  # a new module (its own tensors), the same values
        kernel = layer._kernel
        assert torch.equal(logits(), before) and layer._kernel is not kernel
        assert layer._kernel.linears[1] is attn.o_proj
    finally:
        layer.fused, o_proj.packed, attn.o_proj = True, packed, o_proj


def test_a_layer_run_op_by_op_between_fused_ones_changes_no_bit(trunk):
    """forward_layers runs each run of consecutive fused layers as one C call and an unfused layer
    op by op between them: any one layer unfused gives the all-fused logits, bitwise."""
    ids = [5, 17, 3, 44, 9, 12, 30, 8]

    def logits():
        seq = trunk.new_sequence()
        out = [forward_one(trunk, seq, ids[:6], logits="all").logits, forward_one(trunk, seq, ids[6:7]).logits,
               forward_one(trunk, seq, ids[7:], verify=True).logits]
        trunk.release(seq)
        return out

    fused = logits()
    for layer in trunk.model.layers:
        layer.fused = False
        try:
            assert all(torch.equal(a, b) for a, b in zip(logits(), fused))
        finally:
            layer.fused = True
