"""Helpers: tiny random Gemma 3 models in transformers (the oracle), written to GGUF with llama.cpp's
names and keys, loaded back by our real loader.

The HF -> GGUF map here is written from llama.cpp's converter (convert_hf_to_gguf.py,
Gemma3Model: norm weights stored as 1 + w) and gguf-py's tensor names, independently of
`verispec_gemma4.loader`'s table, so a wrong entry in either shows up as a parity failure.
"""
from __future__ import annotations

import torch

# Odd, distinct sizes; 7 layers with llama.cpp's period-6 pattern give sliding layers on both
# sides of a full one (layer 5). Window 8 is crossed by every test sequence.
TINY_GEMMA3 = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 7,
               "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
               "query_pre_attn_scalar": 16,  # llama.cpp scales by head_dim^-0.5 (no GGUF key for it)
               "max_position_embeddings": 512, "rms_norm_eps": 1e-6}

# HF parameter name (layer i) -> GGUF tensor name.
GEMMA3_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}


def make_hf_gemma3(seed: int = 0, **overrides):
    """A seeded random transformers Gemma3ForCausalLM (eager attention), every weight random
    (norms too, so a missing +1 or a swapped norm cannot hide)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**TINY_GEMMA3, **overrides}, attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if "norm" in name else 0.15))
    return model


def gemma3_gguf_tensors(hf_model) -> dict[str, torch.Tensor]:
    """HF state dict -> GGUF tensors (torch order), norms shifted to 1 + w as llama.cpp stores them."""
    num_layers = hf_model.config.num_hidden_layers
    out = {}
    for hf_name, gguf_name in GEMMA3_HF_TO_GGUF.items():
        for i in range(num_layers) if "{i}" in hf_name else [None]:
            tensor = hf_model.state_dict()[hf_name.format(i=i)].detach().float()
            if hf_name.endswith("norm.weight"):
                tensor = tensor + 1.0
            out[gguf_name.format(i=i)] = tensor
    return out


def gemma3_gguf_metadata(config) -> dict:
    """llama.cpp's gemma3 keys for a transformers Gemma3TextConfig."""
    return {
        "gemma3.context_length": config.max_position_embeddings,
        "gemma3.embedding_length": config.hidden_size,
        "gemma3.block_count": config.num_hidden_layers,
        "gemma3.feed_forward_length": config.intermediate_size,
        "gemma3.attention.head_count": config.num_attention_heads,
        "gemma3.attention.head_count_kv": config.num_key_value_heads,
        "gemma3.attention.key_length": config.head_dim,
        "gemma3.attention.value_length": config.head_dim,
        "gemma3.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "gemma3.rope.freq_base": config.rope_parameters["full_attention"]["rope_theta"],
        "gemma3.attention.sliding_window": config.sliding_window,
    }


def write_gemma3_gguf(path, hf_model, *, drop=(), extra_metadata=None, tensor_types=None) -> str:
    """Write `hf_model` as a gemma3 GGUF (minus the tensors named in `drop`)."""
    from verispec.testing.fixture_writer import write_gguf

    tensors = {k: v for k, v in gemma3_gguf_tensors(hf_model).items() if k not in drop}
    metadata = {**gemma3_gguf_metadata(hf_model.config), **(extra_metadata or {})}
    return write_gguf(path, arch="gemma3", metadata=metadata, tensors=tensors, tensor_types=tensor_types)


def token_ids(n: int, seed: int = 1, vocab_size: int = TINY_GEMMA3["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


# --- Gemma 4 -------------------------------------------------------------------------------

S, FL = "sliding_attention", "full_attention"

# E2B-like: per-layer embeddings, KV sharing (the last 3 layers reuse layers 4 / 3), double-wide
# MLP on the shared layers, proportional RoPE on full layers (head dim 32, 4 of 16 pairs rotate).
TINY_GEMMA4_PLE = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 8,
                   "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
                   "sliding_window": 8, "layer_types": [S, S, S, FL, S, S, S, FL], "hidden_size_per_layer_input": 8,
                   "vocab_size_per_layer_input": 131, "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
                   "final_logit_softcapping": 3.0, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
# 26B-like: MoE beside the dense MLP, K=V full layers with their own KV-head count, no PLE.
TINY_GEMMA4_MOE = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 6,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
                   "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 8,
                   "layer_types": [S, S, FL, S, S, FL], "hidden_size_per_layer_input": 0, "enable_moe_block": True,
                   "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 13, "final_logit_softcapping": 3.0,
                   "max_position_embeddings": 512, "rms_norm_eps": 1e-6}

# HF parameter name -> GGUF tensor name (llama.cpp gemma4 loader names). Norms NOT shifted.
GEMMA4_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    "model.layers.{i}.layer_scalar": "blk.{i}.layer_output_scale.weight",
    "model.layers.{i}.per_layer_input_gate.weight": "blk.{i}.inp_gate.weight",
    "model.layers.{i}.per_layer_projection.weight": "blk.{i}.proj.weight",
    "model.layers.{i}.post_per_layer_input_norm.weight": "blk.{i}.post_norm.weight",
    "model.layers.{i}.router.proj.weight": "blk.{i}.ffn_gate_inp.weight",
    "model.layers.{i}.router.scale": "blk.{i}.ffn_gate_inp.scale",
    "model.layers.{i}.router.per_expert_scale": "blk.{i}.ffn_down_exps.scale",
    "model.layers.{i}.experts.gate_up_proj": "blk.{i}.ffn_gate_up_exps.weight",
    "model.layers.{i}.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    "model.layers.{i}.pre_feedforward_layernorm_2.weight": "blk.{i}.pre_ffw_norm_2.weight",
    "model.layers.{i}.post_feedforward_layernorm_1.weight": "blk.{i}.post_ffw_norm_1.weight",
    "model.layers.{i}.post_feedforward_layernorm_2.weight": "blk.{i}.post_ffw_norm_2.weight",
}


def make_hf_gemma4(preset: dict, seed: int = 0):
    """A seeded random transformers Gemma4ForCausalLM (eager attention and experts); norms, router scales and layer
    scalars random too."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    model = Gemma4ForCausalLM(Gemma4TextConfig(**preset, attn_implementation="eager",
                                                experts_implementation="eager")).eval()  # the reference loop
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("layer_scalar"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif "inv_freq" not in name and "embed_scale" not in name:
                scale = 0.3 if ("norm" in name or "scale" in name) else 0.15
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale + (1.0 if "scale" in name else 0.0))
    return model


def gemma4_gguf_tensors(hf_model) -> dict[str, torch.Tensor]:
    state = hf_model.state_dict()
    out = {}
    for hf_name, gguf_name in GEMMA4_HF_TO_GGUF.items():
        for i in range(hf_model.config.num_hidden_layers) if "{i}" in hf_name else [None]:
            key = hf_name.format(i=i)
            if key in state:  # absent: KV-shared layers' K/V, K=V layers' v_proj, no PLE / MoE
                out[gguf_name.format(i=i)] = state[key].detach().float()
    c = hf_model.config
    rope = c.rope_parameters["full_attention"]
    full_dim = _layer_dims(c)[0][c.layer_types.index(FL)]
    angles = int(rope.get("partial_rotary_factor", 1.0) * full_dim // 2)
    out["rope_freqs.weight"] = torch.tensor([1.0] * angles + [1e30] * (full_dim // 2 - angles))
    return out


def _layer_dims(config):
    """(head dim, KV heads) per layer: transformers keeps them in per_layer_config."""
    layers = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    return [x.head_dim for x in layers], [x.num_key_value_heads for x in layers]


def gemma4_gguf_metadata(config) -> dict:
    """llama.cpp's gemma4 keys for a transformers Gemma4TextConfig."""
    import numpy as np

    L = config.num_hidden_layers
    first_shared = L - config.num_kv_shared_layers
    head_dims, kv_heads = _layer_dims(config)
    sliding_dim, full_dim = head_dims[config.layer_types.index(S)], head_dims[config.layer_types.index(FL)]
    widths = [config.intermediate_size * (2 if config.use_double_wide_mlp and i >= first_shared else 1)
              for i in range(L)]
    md = {
        "gemma4.context_length": config.max_position_embeddings,
        "gemma4.embedding_length": config.hidden_size,
        "gemma4.block_count": L,
        "gemma4.feed_forward_length": widths if len(set(widths)) > 1 else widths[0],
        "gemma4.attention.head_count": config.num_attention_heads,
        "gemma4.attention.head_count_kv": kv_heads if len(set(kv_heads)) > 1 else kv_heads[0],
        "gemma4.attention.key_length": full_dim,
        "gemma4.attention.value_length": full_dim,
        "gemma4.attention.key_length_swa": sliding_dim,
        "gemma4.attention.value_length_swa": sliding_dim,
        "gemma4.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "gemma4.attention.sliding_window": config.sliding_window,
        "gemma4.attention.sliding_window_pattern": np.array([t == S for t in config.layer_types]),
        "gemma4.attention.shared_kv_layers": config.num_kv_shared_layers,
        "gemma4.embedding_length_per_layer_input": config.hidden_size_per_layer_input,
        "gemma4.rope.freq_base": config.rope_parameters["full_attention"]["rope_theta"],
        "gemma4.rope.freq_base_swa": config.rope_parameters["sliding_attention"]["rope_theta"],
        "gemma4.rope.dimension_count": full_dim,
        "gemma4.rope.dimension_count_swa": sliding_dim,
        "gemma4.final_logit_softcapping": config.final_logit_softcapping,
    }
    if config.enable_moe_block:
        md.update({"gemma4.expert_count": config.num_experts, "gemma4.expert_used_count": config.top_k_experts,
                   "gemma4.expert_feed_forward_length": config.moe_intermediate_size})
    return md


def write_gemma4_gguf(path, hf_model) -> str:
    from verispec.testing.fixture_writer import write_gguf

    return write_gguf(path, arch="gemma4", metadata=gemma4_gguf_metadata(hf_model.config),
                      tensors=gemma4_gguf_tensors(hf_model))
