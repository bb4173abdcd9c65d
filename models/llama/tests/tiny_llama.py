"""Tiny random llama / qwen2 models in transformers, written to GGUF as llama.cpp's converter would.

`build_hf_model(name)` builds the seeded transformers model of `TINY_CONFIGS[name]` (its weights
redrawn by `redraw_unit_gain`, which other packages' tiny llama targets share);
`write_fixture(model, path)` maps its state dict to GGUF names and layout (`hf_to_gguf`:
llama's Q/K row permutation, llama3 `rope_freqs`) and writes it with
`verispec.testing.fixture_writer`. conftest's `tiny_fixture(name)` caches both per session.
Sizes are odd and distinct so a transposed or mis-sized weight cannot pass; the `*_int8`
configs keep every linear input width a multiple of 16 (torch's int8 kernel needs it).
"""
from __future__ import annotations

import math

import torch

#: name -> (architecture, transformers config kwargs)
TINY_CONFIGS = {
    # untied head, plain RoPE, GQA 3:1
    "llama": ("llama", {
        "vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": False}),
    # tied head, q/k/v/o biases, llama3 frequency scaling (llama.cpp writes rope_freqs)
    "llama_tied_bias_llama3": ("llama", {
        "vocab_size": 137, "hidden_size": 40, "intermediate_size": 43, "num_hidden_layers": 3,
        "num_attention_heads": 5, "num_key_value_heads": 5, "tie_word_embeddings": True, "attention_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # q/k/v biases, untied head, GQA 4:2
    "qwen2": ("qwen2", {
        "vocab_size": 139, "hidden_size": 56, "intermediate_size": 41, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    # tied head, linear RoPE scaling (position interpolation)
    "qwen2_tied_linear": ("qwen2", {
        "vocab_size": 127, "hidden_size": 36, "intermediate_size": 29, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    # int8-safe sizes for the conformance suites (all dtypes)
    "llama_int8": ("llama", {
        "vocab_size": 131, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2_int8": ("qwen2", {
        "vocab_size": 139, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
}


def build_hf_model(name: str, seed: int = 0):
    """The seeded transformers model of TINY_CONFIGS[name], fp32, eager attention.

    Weights are redrawn at ~unit gain (transformers' 0.02 init gives near-uniform logits,
    which would make parity trivial and greedy streams full of near-ties)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, kwargs = TINY_CONFIGS[name]
    kwargs = {"rms_norm_eps": 1e-5, "max_position_embeddings": 512, **kwargs}
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    return redraw_unit_gain(model, seed)


def redraw_unit_gain(model, seed: int = 0):
    """Redraw every weight of a transformers llama / qwen2 `model` in place from one seeded generator,
    in parameter order, at ~unit gain: norms 1 + 0.2·N(0, 1), biases 0.3·N(0, 1), embedding and LM
    head rows N(0, 1), every other matrix N(0, 1/in). Returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif pname.endswith("embed_tokens.weight") or pname == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


# --- HF -> GGUF (llama.cpp convert_hf_to_gguf.py: LlamaModel / Qwen2Model) -------------------

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: within each head, rotate-half rows (i, i + Dh/2) become
    adjacent rows (2i, 2i + 1) for its interleaved ("normal") RoPE. w: [heads·Dh, ...]."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> torch.Tensor:
    """fp32 [Dh/2]: the `rope_freqs` factors llama.cpp's converter writes for rope_type llama3."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def hf_to_gguf(model) -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's names and layout."""
    cfg = model.config
    arch = cfg.model_type
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    metadata = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{arch}.rope.freq_base": float(rope["rope_theta"]),
    }
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        metadata[f"{arch}.vocab_size"] = cfg.vocab_size
        metadata[f"{arch}.rope.dimension_count"] = head_dim
    if rope["rope_type"] == "linear":
        metadata[f"{arch}.rope.scaling.type"] = "linear"
        metadata[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
    tensors = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                tensors["output.weight"] = w
        else:
            _, _, bid, rest = name.split(".", 3)
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                w = permute_qk(w, cfg.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                w = permute_qk(w, cfg.num_key_value_heads)
            tensors[f"blk.{bid}.{_LAYER_NAMES[rest]}"] = w
    if rope["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim)
    return arch, metadata, tensors


def write_fixture(model, path, *, extra_metadata=None, extra_tensors=None) -> str:
    """Write `model` as a GGUF at `path`; extra_* add or override keys / tensors (variants)."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model)
    return write_gguf(path, arch=arch, metadata={**metadata, **(extra_metadata or {})},
                      tensors={**tensors, **(extra_tensors or {})})
