"""Tiny random GLM-5.3-Flash-style (`glm5_next`) text models in transformers, written to GGUF as
llama.cpp's converter would.

`build_hf_model(name)` builds the seeded transformers `Glm5NextTextModel` of `TINY_CONFIGS[name]`
with an untied LM head (`TinyGlm5Next`; transformers 5.24 has no text-only causal LM for
glm5_next), random weights at ~unit gain (`tiny_glm4moe._draw`), and a NextN block `mtp`:
transformers' own `MtpLayer` (enorm, hnorm, eh_proj, post_norm) over a plain-residual layer of
Glm5NextTextAttention and Glm5NextTextMoE (`_MtpBlock`; transformers 5.24 has no MTP model for
glm5_next, so the layer is composed here, §6.9); `nextn_reference` runs it.
`hf_to_gguf` is the HF -> GGUF map written from llama.cpp's naming (docs/reference/glm5-nemotron.md
§2, §6.3, §6.4, §11.4), independently of the loader's table: the KDA conv split into
`ssm_conv1d_{q,k,v}` [d_inner, 1, K], `ssm_a` = -exp(A_log), `kv_b_proj` split per head into
`attn_k_b` [H, kvL, nope] (transposed) and `attn_v_b` [H, vh, kvL], the k-pool gate and position
embedding as `indexer_compressor_{gate,ape}`, mHC as `hc_{attn,ffn}_{fn,base,scale}`,
`head_count_kv` 0 on KDA layers and 1 on MLA layers, `rope.dimension_count` 0.

Sizes are odd where they can be (vocab 151, D 48, H 3, KDA head 16, qL 24, kvL 20, nope 12,
vh 14), index_topk 16 with kpool 4 (4 pools) is far below the 80-token contexts the tests run,
and the indexer has 16 heads so pool scores are almost never exact ReLU ties.
"""
from __future__ import annotations

import torch
from tiny_glm4moe import _draw, _layer_tensors
from torch import nn

_COMMON = {
    "vocab_size": 151, "hidden_size": 48, "num_hidden_layers": 4, "num_attention_heads": 3,
    "num_key_value_heads": 3, "intermediate_size": 37, "moe_intermediate_size": 19,
    "n_routed_experts": 5, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 20,
    "qk_nope_head_dim": 12, "qk_rope_head_dim": 0, "v_head_dim": 14, "index_topk": 16,
    "index_head_dim": 32, "index_n_heads": 16, "index_kpool": 4, "index_kpool_always_select_tail": True,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "linear_head_dim": 16, "linear_num_heads": 3, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "swiglu_limit": 1.5, "pad_token_id": None,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "indexer_types": ["full"] * 4,
}
#: name -> transformers config kwargs. swiglu_limit 1.5 (Flash: 10) so the clamp bites at unit gain.
TINY_CONFIGS = {
    "flash": _COMMON,
    # block-quantisable widths (every linear's input a multiple of 32) for the `gguf` weight mode
    # (a file has one head count: KDA's heads are the MLA's)
    "blocks": {**_COMMON, "vocab_size": 160, "hidden_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
               "q_lora_rank": 32, "kv_lora_rank": 32,
               "qk_nope_head_dim": 32, "v_head_dim": 32, "linear_head_dim": 32, "linear_num_heads": 2},
}


class TinyGlm5Next(nn.Module):
    """transformers' Glm5NextTextModel and an untied LM head: tokens int64 [B, T] -> logits [B, T, V]."""

    def __init__(self, config):
        super().__init__()
        from transformers.modeling_layers import MtpLayer
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel, Glm5NextTextRMSNorm

        self.config = config
        self.model = Glm5NextTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MtpLayer(config, _MtpBlock, Glm5NextTextRMSNorm, 0)  # drawn after the trunk

    def forward(self, input_ids, cache=None, use_cache=False):
        out = self.model(input_ids=input_ids, cache=cache, use_cache=use_cache)
        return self.lm_head(out.last_hidden_state)


class _MtpBlock(nn.Module):
    """The NextN block's decoder layer as MtpLayer calls it: NoPE MLA with its own k-pool indexer
    over the whole run (no cache), the MoE, plain residuals."""

    def __init__(self, config, layer_idx):
        import copy

        from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextTextAttention, Glm5NextTextMoE,
                                                                      Glm5NextTextRMSNorm)

        super().__init__()
        config = copy.deepcopy(config)
        config.indexer_types = ["full"] * config.num_hidden_layers
        self.input_layernorm = Glm5NextTextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Glm5NextTextAttention(config, layer_idx)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Glm5NextTextMoE(config)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        x = self.input_layernorm(hidden_states)
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
        hidden_states = hidden_states + self.self_attn(x, attention_mask=mask, cache=None)[0]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def nextn_reference(model: TinyGlm5Next, tokens: torch.Tensor, hidden: torch.Tensor):
    """The MtpLayer over pairs (hidden[j], tokens[j]), every pair causal over the earlier ones, with
    the trunk's embedding and LM head (differentiable in the head's weights): tokens int64 [T],
    hidden fp32 [T, D] -> (logits [T, V], h' [T, D]); batched: [B, T], [B, T, D] -> [B, T, V], [B, T, D]."""
    batched = tokens.dim() == 2
    if not batched:
        tokens, hidden = tokens[None], hidden[None]
    h_out = model.mtp(model.model.embed_tokens(tokens), hidden, None, None, None, None)
    logits = model.lm_head(h_out)
    return (logits, h_out) if batched else (logits[0], h_out[0])


def trunk_hidden(model: TinyGlm5Next, tokens: torch.Tensor) -> torch.Tensor:
    """The trunk's final-normed rows fp32 [T, D] of tokens int64 [T]."""
    with torch.no_grad():
        return model.model(input_ids=tokens[None]).last_hidden_state[0]


def build_hf_model(name: str, seed: int = 0) -> TinyGlm5Next:
    """The seeded `TinyGlm5Next` fp32 eager of TINY_CONFIGS[name]."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    config = Glm5NextTextConfig(**TINY_CONFIGS[name])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = TinyGlm5Next(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(_draw(pname, p.shape, g))
            if pname.endswith("hc.scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            if pname.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
        for pname, b in model.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.copy_(_draw(pname, b.shape, g))
    return model


def hf_prefill_and_decodes(model: TinyGlm5Next, prompt: list[int], continuation: list[int]):
    """HF logits fp32 [len(prompt), V] of the prompt, then [len(continuation), V] of one-token decodes."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill = model(torch.tensor([prompt]), cache=cache, use_cache=True)[0]
        decodes = [model(torch.tensor([[t]]), cache=cache, use_cache=True)[0] for t in continuation]
    return prefill, torch.cat(decodes) if decodes else prefill[:0]


# --- HF -> GGUF (llama.cpp: glm5-next) -----------------------------------------------------------

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    # KDA
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.forget_gate.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.forget_gate.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.forget_gate.dt_bias": "ssm_dt.bias",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.g_a_proj.weight": "ssm_g_a.weight", "self_attn.g_b_proj.weight": "ssm_g_b.weight",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    # NoPE MLA + k-pool indexer
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate.weight",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape.weight",
    # mHC
    **{f"{part}_hc.{name}": f"hc_{part}_{name}.weight"
       for part in ("attn", "ffn") for name in ("fn", "base", "scale")},
}


def hf_to_gguf(model: TinyGlm5Next, arch: str = "glm5-next") -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's glm5-next names and layout."""
    cfg, a = model.config, arch
    heads, nope, vh, n = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_hidden_layers
    blocks = n + 1  # the NextN block blk.{n}
    dense = sum(t == "dense" for t in cfg.mlp_layer_types)
    metadata = {
        f"{a}.block_count": blocks,
        f"{a}.nextn_predict_layers": 1,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": [0 if t == "linear_attention" else 1 for t in cfg.layer_types] + [1],
        f"{a}.attention.key_length": cfg.kv_lora_rank,
        f"{a}.attention.value_length": cfg.kv_lora_rank,
        f"{a}.attention.key_length_mla": nope,
        f"{a}.attention.value_length_mla": vh,
        f"{a}.attention.q_lora_rank": cfg.q_lora_rank,
        f"{a}.attention.kv_lora_rank": cfg.kv_lora_rank,
        f"{a}.rope.dimension_count": 0,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.attention.layer_norm_epsilon": 1e-6,
        f"{a}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{a}.kda.head_dim": cfg.linear_head_dim,
        f"{a}.kda.gate_lower_bound": float(cfg.linear_lower_bound),
        f"{a}.expert_count": cfg.n_routed_experts,
        f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_shared_count": cfg.n_shared_experts,
        f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{a}.leading_dense_block_count": dense,
        f"{a}.expert_gating_func": 2,
        f"{a}.expert_weights_scale": float(cfg.routed_scaling_factor),
        f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
        f"{a}.swiglu_clamp_exp": [float(cfg.swiglu_limit)] * blocks,
        f"{a}.swiglu_clamp_shexp": [float(cfg.swiglu_limit)] * blocks,
        f"{a}.attention.indexer.head_count": cfg.index_n_heads,
        f"{a}.attention.indexer.key_length": cfg.index_head_dim,
        f"{a}.attention.indexer.top_k": cfg.index_topk,
        f"{a}.attention.indexer.kpool": cfg.index_kpool,
        f"{a}.attention.indexer.kpool_select_tail": bool(cfg.index_kpool_always_select_tail),
        f"{a}.hyper_connection.count": cfg.hc_mult,
        f"{a}.hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        f"{a}.hyper_connection.epsilon": cfg.hc_eps,
        f"{a}.vocab_size": cfg.vocab_size,
    }
    tensors = {}
    nextn = {"mtp.eh_proj.weight": "nextn.eh_proj.weight", "mtp.enorm.weight": "nextn.enorm.weight",
             "mtp.hnorm.weight": "nextn.hnorm.weight",
             "mtp.post_norm.weight": "nextn.shared_head_norm.weight"}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if name in nextn:
            tensors[f"blk.{n}.{nextn[name]}"] = w
            continue
        if name.startswith("mtp.mtp_block."):
            name = f"model.layers.{n}.{name.removeprefix('mtp.mtp_block.')}"
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            tensors["output.weight"] = w
        else:
            _, _, bid, rest = name.split(".", 3)
            b = f"blk.{bid}."
            if rest == "self_attn.conv1d.weight":  # [3·d_inner, 1, K]: q | k | v channels
                for part, t in zip("qkv", w.chunk(3)):
                    tensors[b + f"ssm_conv1d_{part}.weight"] = t.contiguous()
            elif rest == "self_attn.forget_gate.A_log":
                tensors[b + "ssm_a"] = -w.exp()
            elif rest == "self_attn.kv_b_proj.weight":
                per_head = w.view(heads, nope + vh, -1)
                tensors[b + "attn_k_b.weight"] = per_head[:, :nope].transpose(1, 2).contiguous()
                tensors[b + "attn_v_b.weight"] = per_head[:, nope:].contiguous()
            elif rest in _NAMES:
                tensors[b + _NAMES[rest]] = w
            else:
                for suffix, t in _layer_tensors(rest, w).items():
                    tensors[b + suffix] = t
    return a, metadata, tensors


def write_fixture(model: TinyGlm5Next, path, *, arch: str = "glm5-next", extra_metadata=None,
                  drop_metadata=(), tensor_types=None) -> str:
    """Write `model` as a GGUF at `path`; extra_ / drop_metadata make variants."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model, arch)
    metadata = {k: v for k, v in {**metadata, **(extra_metadata or {})}.items() if k not in drop_metadata}
    return write_gguf(path, arch=arch, metadata=metadata, tensors=tensors, tensor_types=tensor_types)


if __name__ == "__main__":
    import sys

    name, out = sys.argv[1:3]
    print(write_fixture(build_hf_model(name), out))
