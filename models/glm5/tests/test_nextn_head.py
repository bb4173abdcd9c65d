"""The NextN draft head of each architecture (verispec.testing.NextNHeadSuite): its steps against
transformers' own MTP layer over the architecture's decoder layer (`nextn_reference` of its test
map) through commits, keeps and gaps, exact streams under the `mtp` speculator, and a short
training that makes `mtp` accept most drafts; then what only one architecture's files do.

glm-dsa's runs reach 31 positions, past index_topk (24): its own indexer restricts the head's
attention in the later steps, as the reference layer's does. glm5-next's pass index_topk 16 with
kpool 4: its indexer then selects 4 of the head's complete pools plus its tail."""
import pytest
import torch
from glm_archs import ARCHS
from verispec.testing import NextNCase, NextNHeadSuite, NextNTraining

pytest.importorskip("transformers")


def _reference(arch, model, mtp):
    """The arch's reference block as `NextNHeadSuite` calls it: (tokens, hidden, positions)."""
    tiny = arch.module()
    if arch.name == "glm4moe":
        return lambda tokens, hidden, positions: tiny.nextn_reference(mtp, tokens, hidden, positions)
    if arch.name == "glm-dsa":
        return lambda tokens, hidden, positions: tiny.nextn_reference(model, mtp, tokens, hidden, positions)
    return lambda tokens, hidden, positions: tiny.nextn_reference(model, tokens, hidden)  # NoPE: no positions


class _GlmNextNHead(NextNHeadSuite):
    arch: str

    @pytest.fixture(scope="class")
    @classmethod
    def nextn_case(cls, tiny_glm):
        arch = ARCHS[cls.arch]
        model, mtp, path = tiny_glm(arch.name)
        tokens = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            if arch.block_in_model:
                hidden = arch.module().trunk_hidden(model, tokens)
            else:  # final-normed [n, D]
                hidden = model(tokens[None], output_hidden_states=True).hidden_states[-1][0]
        return NextNCase(arch.load(path, dtype="float32").draft_head, _reference(arch, model, mtp), tokens, hidden)

    @pytest.fixture(scope="class")
    @classmethod
    def nextn_trunk(cls, tiny_glm):
        arch = ARCHS[cls.arch]
        path = tiny_glm(arch.name)[2]
        return lambda dtype: arch.load(path, dtype=dtype)

    @pytest.fixture
    def nextn_training(self, tiny_glm):
        arch = ARCHS[self.arch]
        model, mtp = arch.build(arch.nextn)  # a fresh copy: the session's fixture stays untrained
        for p in model.parameters():
            p.requires_grad_(False)  # only the head trains (its embedding and LM head are the trunk's)
        for p in mtp.parameters() if arch.block_in_model else ():
            p.requires_grad_(True)
        return NextNTraining(trunk=arch.load(tiny_glm(arch.name)[2], dtype="float32"), block=mtp,
                             reference=_reference(arch, model, mtp),
                             write=lambda path: arch.write(model, mtp, path),
                             load=lambda path: arch.load(path, dtype="float32"))


class TestGlm4MoeNextNHead(_GlmNextNHead):
    arch = "glm4moe"


class TestGlmDsaNextNHead(_GlmNextNHead):
    arch = "glm-dsa"
    kept = (3, 1, 5, 2, 4, 6)
    selects_past = 24  # index_topk
    stream_tokens = 40
    num_streams, num_generated, num_steps, max_loss = 12, 40, 200, 0.2


class TestGlm5NextNextNHead(_GlmNextNHead):
    arch = "glm5-next"
    kept = (3, 1, 5, 2, 4, 6)
    selects_past = 16 + 4  # index_topk + kpool
    gap_end = 30  # the head's pools count from the gap
    stream_tokens = 40
    num_streams, num_generated, num_steps, max_loss = 12, 40, 200, 0.2


def test_glm4moe_reads_the_blocks_own_embedding_and_head_when_the_file_has_them(tiny_glm, tmp_path):
    """A NextN block with nextn.embed_tokens / nextn.shared_head_head (llama.cpp reads them when
    present): the head embeds and projects with those, not the trunk's."""
    arch = ARCHS["glm4moe"]
    hf_model, mtp, _ = tiny_glm(arch.name)
    n, v, d = hf_model.config.num_hidden_layers, hf_model.config.vocab_size, hf_model.config.hidden_size
    g = torch.Generator().manual_seed(5)
    embed, lm_head = 0.3 * torch.randn(v, d, generator=g), 0.3 * torch.randn(v, d, generator=g)
    path = arch.write(hf_model, mtp, tmp_path / "own.gguf",
                      extra_tensors={f"blk.{n}.nextn.embed_tokens.weight": embed,
                                     f"blk.{n}.nextn.shared_head_head.weight": lm_head})
    trunk = arch.load(path, dtype="float32", use_cache=False)
    assert trunk.config.nextn_has_embed_tokens and trunk.config.nextn_has_shared_head
    tokens = torch.tensor([3, 9, 27, 81, 100])
    hidden = torch.randn(5, d, generator=g)
    layer = mtp.layers[0]
    with torch.no_grad():
        x = layer.eh_proj(torch.cat([layer.enorm(embed[tokens]), layer.hnorm(hidden)], dim=-1))[None]
        cos_sin = mtp.rotary_emb(x, torch.arange(1, 6)[None])
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        out = layer.mtp_block(x, attention_mask=mask, position_embeddings=cos_sin)
        expected = layer.post_norm(out)[0, -1]
    state = trunk.draft_head.new_state()
    head = trunk.draft_head
    head.draft_catch_up(state, [0, *tokens[:4].tolist()], torch.cat([hidden[:4], hidden[4:]]), 0)
    logits, h_out = head.draft_step(state, int(tokens[4]), hidden[4], 5)
    torch.testing.assert_close(h_out, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, expected @ lm_head.T, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, name", [("glm4moe", "grouped"), ("glm-dsa", "full")])
def test_no_nextn_block_no_head(tiny_glm, arch, name):
    assert ARCHS[arch].load(tiny_glm(arch, name)[2], dtype="float32").draft_head is None


@pytest.mark.parametrize("arch", ["glm4moe", "glm-dsa"])
def test_a_declared_nextn_block_without_its_tensors_is_refused(tiny_glm, tmp_path, arch):
    """A file declaring a NextN block without its tensors is refused with the fix named (llama.cpp
    loads it as trunk-only; this loader asks for the key to be dropped instead)."""
    from verispec_glm5.modeling_glm4moe import UnsupportedGlm4MoeVariant

    a = ARCHS[arch]
    hf_model, mtp, _ = tiny_glm(arch)
    n = hf_model.config.num_hidden_layers
    _, _, tensors = a.hf_to_gguf(hf_model, mtp)
    trunk_only = a.write(hf_model, mtp, tmp_path / "trunk-only.gguf",
                         drop_tensors=[t for t in tensors if t.startswith(f"blk.{n}.")])
    with pytest.raises(UnsupportedGlm4MoeVariant, match="drop the key"):
        a.load(trunk_only, dtype="float32", use_cache=False)


@pytest.mark.parametrize("arch", ["glm4moe", "glm-dsa", "glm5-next"])
def test_a_nextn_block_with_non_finite_weights_is_refused_at_load(tiny_glm, tmp_path, arch):
    """The NextN block is a draft head inside the trunk's file: a NaN in it is named at load, as a
    drafter file's would be (it would draft junk without a word)."""
    from verispec.errors import DamagedFile
    from verispec.testing.fixture_writer import plant_values

    hf_model, _, path = tiny_glm(arch)
    name = f"blk.{hf_model.config.num_hidden_layers}.nextn.eh_proj.weight"
    bad = plant_values(path, tmp_path / "bad-head.gguf", name, [float("nan")])
    with pytest.raises(DamagedFile, match=f"tensor '{name}' holds 1 NaN of "):
        ARCHS[arch].load(bad, dtype="float32", use_cache=False)
