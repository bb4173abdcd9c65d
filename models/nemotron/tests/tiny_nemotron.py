"""Tiny random Nemotron-H models in transformers, written to GGUF as llama.cpp's converter lays them out.

`build_hf_model(name)` builds the seeded transformers model of `TINY_CONFIGS[name]`;
`write_fixture(model, path)` maps its state dict to GGUF names and layout (`hf_to_gguf`) and
writes it with `verispec.testing.fixture_writer`. conftest's `tiny_fixture(name)` caches both.

The map is written from docs/reference/glm5-nemotron.md §7.2-7.3 (llama.cpp's names and shapes):
`ssm_a` = -exp(A_log) [Hm, 1], `ssm_d` [Hm, 1], `ssm_norm` [G, di/G], `ssm_conv1d` [C, K]
(HF's conv1d.weight is [C, 1, K]); the block pattern is the per-layer head_count_kv /
feed_forward_length arrays; MoE files are `nemotron_h_moe`.
"""
from __future__ import annotations

import math

import torch

#: name -> transformers NemotronHConfig kwargs. Patterns: M Mamba-2, * attention, - MLP, E MoE.
TINY_CONFIGS = {
    "dense": {
        "vocab_size": 151, "hidden_size": 48, "hybrid_override_pattern": "M*-M-",
        "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 40,
        "mamba_num_heads": 4, "mamba_head_dim": 12, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4,
        "chunk_size": 16,
    },
    "moe": {
        "vocab_size": 163, "hidden_size": 48, "hybrid_override_pattern": "ME*ME",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "mamba_num_heads": 6, "mamba_head_dim": 8, "n_groups": 3, "ssm_state_size": 8, "conv_kernel": 4,
        "chunk_size": 16, "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "moe_shared_expert_intermediate_size": 32, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    },
}


def build_hf_model(name: str, seed: int = 0):
    """The seeded transformers model of TINY_CONFIGS[name], fp32, eager attention.

    Weights are redrawn at ~unit gain (the 0.02 init gives near-uniform logits). dt_bias stays
    small so softplus(dt) is never below 1e-3: transformers 5.24 clamps dt at time_step_min in
    its chunked prefill but not in its one-row step (and llama.cpp never clamps)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(**TINY_CONFIGS[name], layer_norm_epsilon=1e-5, max_position_embeddings=512,
                             tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.state_dict().items():
            if not p.is_floating_point():
                continue
            leaf = pname.rsplit(".", 1)[-1]
            if pname.endswith("norm.weight") or pname.endswith("norm_f.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif leaf == "A_log":
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4.0, generator=g)))
            elif leaf == "D":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif leaf == "dt_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias") or leaf == "e_score_correction_bias":
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif pname.endswith("embeddings.weight") or pname == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in] or experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


# --- HF -> GGUF ---------------------------------------------------------------------------

_MIXER_NAMES = {
    "in_proj.weight": "ssm_in.weight", "conv1d.bias": "ssm_conv1d.bias", "dt_bias": "ssm_dt.bias",
    "out_proj.weight": "ssm_out.weight",
    "q_proj.weight": "attn_q.weight", "k_proj.weight": "attn_k.weight", "v_proj.weight": "attn_v.weight",
    "o_proj.weight": "attn_output.weight",
    "up_proj.weight": "ffn_up.weight", "down_proj.weight": "ffn_down.weight",
    "gate.weight": "ffn_gate_inp.weight", "gate.e_score_correction_bias": "exp_probs_b.bias",
    "experts.up_proj": "ffn_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
    "shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _mixer_tensor(rest: str, w: torch.Tensor, cfg) -> tuple[str, torch.Tensor]:
    if rest == "A_log":
        return "ssm_a", -torch.exp(w.float())[:, None]
    if rest == "D":
        return "ssm_d", w[:, None]
    if rest == "conv1d.weight":
        return "ssm_conv1d.weight", w[:, 0, :]
    if rest == "norm.weight":
        return "ssm_norm.weight", w.reshape(cfg.n_groups, -1)
    return _MIXER_NAMES[rest], w


def hf_to_gguf(model) -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's names and layout."""
    cfg = model.config
    types = cfg.layers_block_type
    moe = "moe" in types
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    ffn = {"mlp": cfg.intermediate_size, "moe": cfg.moe_intermediate_size}
    metadata = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": len(types),
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": [cfg.num_key_value_heads if t == "full_attention" else 0
                                            for t in types],
        f"{arch}.feed_forward_length": [ffn.get(t, 0) for t in types],
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.attention.layer_norm_epsilon": cfg.layer_norm_epsilon,
        f"{arch}.ssm.conv_kernel": cfg.conv_kernel,
        f"{arch}.ssm.inner_size": cfg.mamba_num_heads * cfg.mamba_head_dim,
        f"{arch}.ssm.state_size": cfg.ssm_state_size,
        f"{arch}.ssm.time_step_rank": cfg.mamba_num_heads,
        f"{arch}.ssm.group_count": cfg.n_groups,
    }
    if moe:
        metadata.update({
            f"{arch}.expert_count": cfg.n_routed_experts,
            f"{arch}.expert_used_count": cfg.num_experts_per_tok,
            f"{arch}.expert_feed_forward_length": cfg.moe_intermediate_size,
            f"{arch}.expert_shared_feed_forward_length": cfg.moe_shared_expert_intermediate_size,
            f"{arch}.expert_shared_count": 1, f"{arch}.expert_weights_norm": bool(cfg.norm_topk_prob),
            f"{arch}.expert_weights_scale": float(cfg.routed_scaling_factor), f"{arch}.expert_group_count": 1,
        })
    tensors = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if name == "model.embeddings.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm_f.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            tensors["output.weight"] = w
        else:
            _, _, bid, rest = name.split(".", 3)
            if rest == "norm.weight":
                tensors[f"blk.{bid}.attn_norm.weight"] = w
            else:
                gguf_name, w = _mixer_tensor(rest.removeprefix("mixer."), w, cfg)
                tensors[f"blk.{bid}.{gguf_name}"] = w
    return arch, metadata, tensors


def write_fixture(model, path, *, extra_metadata=None, extra_tensors=None, drop=()) -> str:
    """Write `model` as a GGUF at `path`; extra_* add or override keys / tensors, `drop` removes
    tensors or keys (variants for the loader's refusals)."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model)
    metadata = {k: v for k, v in {**metadata, **(extra_metadata or {})}.items() if k not in drop}
    tensors = {k: v for k, v in {**tensors, **(extra_tensors or {})}.items() if k not in drop}
    return write_gguf(path, arch=arch, metadata=metadata, tensors=tensors)
