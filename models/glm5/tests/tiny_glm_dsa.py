"""Tiny random GLM-5-style (`glm_moe_dsa`) models in transformers, written to GGUF as llama.cpp's
converter would.

`build_hf_model(name)` builds the seeded transformers `GlmMoeDsaForCausalLM` of `TINY_CONFIGS[name]`
with random weights (`tiny_glm4moe.draw_weights`: ~unit gain) and, for the names in `WITH_NEXTN`, a
NextN block as transformers' own `MtpLayer` (modeling_layers: enorm, hnorm, eh_proj, post_norm)
over a GlmMoeDsaDecoderLayer with the MoE and its own indexer (`_MtpBlock`; transformers 5.24 has
no MtpModel for glm_moe_dsa, so the layer is composed here); `nextn_reference` runs it.
`hf_to_gguf` is the HF -> GGUF map written from llama.cpp's naming (docs/reference/glm5-nemotron.md
§2, §5.3, §11.3), independently of the loader's table: `kv_b_proj` split per head into
`attn_k_b` [H, kvL, nope] (transposed) and `attn_v_b` [H, vh, kvL], the indexer under
`blk.{i}.indexer.*` on full layers only, `ffn_norm` for the pre-FFN norm, the NextN block as
`blk.{L}` with its nextn.* tensors, and the `glm-dsa.*` keys (MLA stored as MQA: head_count_kv
1, key_length kvL + rope, value_length kvL; the decompressed sizes in *_mla;
`attention.indexer.types` as a bool array, true = full).

Sizes are odd and distinct (qL 24, kvL 20, nope 12, rope 8, vh 14, H 3, D 48), index_topk 24 is
below the 80-token contexts the tests run (so the selection is not the identity), and the
indexer has 16 heads so a key's score is almost never an exact 0 (ReLU of every head's dot
product) that would make top-k ties.
"""
from __future__ import annotations

import torch
from tiny_glm4moe import _NEXTN, _layer_tensors, draw_weights, moe_metadata, trunk_end

_COMMON = {
    "vocab_size": 151, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3,
    "num_key_value_heads": 3, "intermediate_size": 37, "moe_intermediate_size": 19,
    "n_routed_experts": 5, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 20,
    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 14, "index_topk": 24,
    "index_head_dim": 64, "index_n_heads": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
#: name -> transformers config kwargs
TINY_CONFIGS = {
    # GLM-5.2 IndexShare: layer 1 reuses layer 0's top-k set (the file carries the types array)
    "shared": {**_COMMON, "indexer_types": ["full", "shared", "full"]},
    # GLM-5 / 5.1: every layer runs its indexer (no types key in the file, context < 1048576);
    # expert groups (8 experts in 4 groups, the best 2 kept), tied head, two dense layers
    "full": {**_COMMON, "num_hidden_layers": 4, "indexer_types": ["full"] * 4, "n_routed_experts": 8,
             "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "first_k_dense_replace": 2,
             "tie_word_embeddings": True, "index_topk": 17},
    # block-quantisable widths (every linear's input a multiple of 32) for the `gguf` weight mode
    "blocks": {**_COMMON, "vocab_size": 160, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 32,
               "qk_nope_head_dim": 16, "v_head_dim": 16, "indexer_types": ["full", "shared", "full"]},
    # for benchmarks/verify_cost.py (`python models/glm5/tests/tiny_glm_dsa.py bench OUT.gguf`): GLM-5's
    # proportions at 1/12 its width (D 512, 8 heads, latent 64 + rope 8; 64 experts of width 256, top-8,
    # one shared; 1 dense layer of 4; top-k 128 keys of ~200 cached, so the selection is sparse)
    "bench": {**_COMMON, "vocab_size": 4096, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
              "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 64,
              "num_experts_per_tok": 8, "num_hidden_layers": 4, "q_lora_rank": 256, "kv_lora_rank": 64,
              "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 32, "index_topk": 128,
              "index_head_dim": 32, "index_n_heads": 4, "indexer_types": ["full"] * 4, "max_position_embeddings": 2048},
}


#: configs written with a NextN block blk.{L}
WITH_NEXTN = ("shared", "blocks")


def build_hf_model(name: str, seed: int = 0):
    """(the seeded transformers GlmMoeDsaForCausalLM fp32 eager, its NextN MtpLayer or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("glm_moe_dsa", **TINY_CONFIGS[name])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                             experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    draw_weights(model, g)
    mtp = None
    if name in WITH_NEXTN:
        from transformers.modeling_layers import MtpLayer

        mtp = MtpLayer(config, _mtp_block_class(), type(model.model.norm), 0).eval()
        draw_weights(mtp, g)
    return model, mtp


def _mtp_block_class():
    """GlmMoeDsaDecoderLayer as MtpLayer calls it: (config, 0) built as a MoE layer with its own
    indexer (the NextN block's), returning the hidden states alone."""
    import copy

    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    class _MtpBlock(GlmMoeDsaDecoderLayer):
        def __init__(self, config, layer_idx):
            config = copy.deepcopy(config)
            config.mlp_layer_types = ["sparse"] * config.num_hidden_layers
            config.indexer_types = ["full"] * config.num_hidden_layers
            super().__init__(config, layer_idx)

        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)[0]

    return _MtpBlock


def nextn_reference(model, mtp, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """transformers' MtpLayer over pairs (hidden[j], tokens[j]) at positions[j], every pair causal over
    the earlier ones, with the trunk's embedding and LM head. tokens int64 [T] (or [B, T]), hidden
    fp32 [T, D] ([B, T, D]), positions int64 [T] -> (logits [T, V], h' [T, D]) (batched: [B, T, V],
    [B, T, D])."""
    batched = tokens.dim() == 2
    if not batched:
        tokens, hidden = tokens[None], hidden[None]
    n = tokens.shape[1]
    embeds = model.model.embed_tokens(tokens)
    position_embeddings = model.model.rotary_emb(hidden, positions[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    h_out = mtp(embeds, hidden, position_embeddings, mask, positions[None], None)
    logits = model.lm_head(h_out)
    return (logits, h_out) if batched else (logits[0], h_out[0])


# --- HF -> GGUF (llama.cpp: glm-dsa) ------------------------------------------------------------

_ATTN = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
}


def hf_to_gguf(model, mtp=None) -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's glm-dsa names and layout; `mtp`:
    the NextN MtpLayer (written as blk.{L}) or None."""
    cfg, a = model.config, "glm-dsa"
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    vh = cfg.v_head_dim
    metadata = {
        f"{a}.block_count": cfg.num_hidden_layers + (1 if mtp is not None else 0),
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": cfg.kv_lora_rank + rope,
        f"{a}.attention.value_length": cfg.kv_lora_rank,
        f"{a}.attention.key_length_mla": nope + rope,
        f"{a}.attention.value_length_mla": vh,
        f"{a}.attention.q_lora_rank": cfg.q_lora_rank,
        f"{a}.attention.kv_lora_rank": cfg.kv_lora_rank,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.attention.indexer.head_count": cfg.index_n_heads,
        f"{a}.attention.indexer.key_length": cfg.index_head_dim,
        f"{a}.attention.indexer.top_k": cfg.index_topk,
        f"{a}.rope.dimension_count": rope,
        f"{a}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        **moe_metadata(a, cfg),
    }
    if mtp is not None:
        metadata[f"{a}.nextn_predict_layers"] = 1
    if any(t != "full" for t in cfg.indexer_types):
        metadata[f"{a}.attention.indexer.types"] = [t == "full" for t in cfg.indexer_types]
    tensors = {}
    layers = [(name, w) for name, w in model.state_dict().items()]
    if mtp is not None:
        layers += [(f"model.layers.{cfg.num_hidden_layers}.{k.removeprefix('mtp_block.')}", w)
                   for k, w in mtp.state_dict().items()]
    for name, w in layers:
        w = w.detach().clone()
        if trunk_end(name, w, cfg, tensors) or name.endswith(("rotary_emb.inv_freq",
                                                              "rotary_emb.original_inv_freq")):
            continue
        _, _, bid, rest = name.split(".", 3)
        if rest in _NEXTN and int(bid) == cfg.num_hidden_layers:
            tensors[f"blk.{bid}.{_NEXTN[rest]}"] = w
        elif rest == "self_attn.kv_b_proj.weight":
            # [H·(nope + vh), kvL] -> k_b [H, kvL, nope] (transposed per head), v_b [H, vh, kvL]
            per_head = w.view(heads, nope + vh, -1)
            tensors[f"blk.{bid}.attn_k_b.weight"] = per_head[:, :nope].transpose(1, 2).contiguous()
            tensors[f"blk.{bid}.attn_v_b.weight"] = per_head[:, nope:].contiguous()
        elif rest in _ATTN:
            tensors[f"blk.{bid}.{_ATTN[rest]}"] = w
        else:
            for suffix, t in _layer_tensors(rest, w).items():
                tensors[f"blk.{bid}.{suffix}"] = t
    return a, metadata, tensors


def write_fixture(model, path, *, mtp=None, extra_metadata=None, extra_tensors=None, drop_tensors=(),
                  drop_metadata=(), tensor_types=None) -> str:
    """Write `model` as a GGUF at `path`; extra_* / drop_* make variants; tensor_types: GGUF name
    -> block type (`write_gguf`), the rest F32."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model, mtp)
    tensors = {k: v for k, v in {**tensors, **(extra_tensors or {})}.items() if k not in drop_tensors}
    metadata = {k: v for k, v in {**metadata, **(extra_metadata or {})}.items() if k not in drop_metadata}
    return write_gguf(path, arch=arch, metadata=metadata, tensors=tensors, tensor_types=tensor_types)


if __name__ == "__main__":
    import sys

    name, out = sys.argv[1:3]
    hf_model, hf_mtp = build_hf_model(name)
    print(write_fixture(hf_model, out, mtp=hf_mtp))
