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
TINY_GEMMA3 = dict(vocab_size=131, hidden_size=48, intermediate_size=37, num_hidden_layers=7,
                   num_attention_heads=3, num_key_value_heads=1, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=16,  # llama.cpp scales by head_dim^-0.5 (no GGUF key for it)
                   max_position_embeddings=512, rms_norm_eps=1e-6)

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
