"""Tiny random GLM-4.5-style models in transformers, written to GGUF as llama.cpp's converter would.

`build_hf_model(name)` builds the seeded transformers `Glm4MoeForCausalLM` of `TINY_CONFIGS[name]`
and, when the config has a NextN block, transformers' own `MtpModel` over it (modeling_layers:
MtpLayer = enorm, hnorm, eh_proj, a MoE decoder layer `mtp_block`, post_norm; the trunk's
embedding and LM head), with random weights. `hf_to_gguf` is the HF -> GGUF map written from
llama.cpp's converter naming (conversion/glm.py Glm4MoeModel; docs/reference/glm5-nemotron.md
§3.3, §11.2), independently of the loader's table: plain names, experts' gate_up split, the
NextN block renamed onto `blk.{L}` with its nextn.* tensors, llama.cpp's `glm4moe.*` keys.
Sizes are odd and distinct (H·Dh = 60 != D = 48, Fe = 19 != F = 37, r = 10 of Dh = 20).
"""
from __future__ import annotations

import math

import torch

_COMMON = {
    "vocab_size": 151, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3,
    "num_key_value_heads": 1, "head_dim": 20, "intermediate_size": 37, "moe_intermediate_size": 19,
    "n_routed_experts": 5, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "num_mtp_layers": 0,
}
#: name -> transformers config kwargs
TINY_CONFIGS = {
    # GLM-4.5 / 4.6 / 4.7 layout: q/k norms, biases, one dense leading layer, and a NextN block
    "nextn": {**_COMMON, "num_mtp_layers": 1},
    # GLM-4.5-Air-like: no q/k norms; expert groups (8 experts in 4 groups, the best 2 kept), two
    # shared experts, two dense layers, weights not normalised, tied head
    "grouped": {**_COMMON, "use_qk_norm": False, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                "num_experts_per_tok": 3, "n_shared_experts": 2, "first_k_dense_replace": 2,
                "num_hidden_layers": 4, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "tie_word_embeddings": True},
    # block-quantisable widths (every linear's input a multiple of 32) for the `gguf` weight mode
    "blocks": {**_COMMON, "vocab_size": 160, "hidden_size": 64, "head_dim": 32, "intermediate_size": 96,
               "moe_intermediate_size": 32, "num_mtp_layers": 1},
    # for benchmarks/verify_cost.py (`python models/glm5/tests/tiny_glm4moe.py bench OUT.gguf`): GLM-4.5-Air's
    # proportions at 1/8 the width (D 512, 64 experts of width 256, top-8, one shared, 1 dense layer of 4)
    "bench": {**_COMMON, "vocab_size": 4096, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 1408, "moe_intermediate_size": 256, "n_routed_experts": 64,
              "num_experts_per_tok": 8, "num_hidden_layers": 4, "use_qk_norm": False, "max_position_embeddings": 2048},
}


def build_hf_model(name: str, seed: int = 0):
    """(the seeded transformers model fp32 eager, its transformers MtpModel or None).

    Weights are redrawn at ~unit gain (the 0.02 init gives near-uniform logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    config = AutoConfig.for_model("glm4_moe", **TINY_CONFIGS[name])
    torch.manual_seed(seed)
    # transformers' grouped_mm experts need 16-byte-aligned strides; the eager loop does not
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                             experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    draw_weights(model, g)
    mtp = None
    if config.num_mtp_layers:
        mtp = MtpModel(model, config.num_mtp_layers).eval()
        draw_weights(mtp, g, keep=("embed_tokens.", "shared_head."))  # the trunk's, drawn above
    return model, mtp


def draw_weights(module, g: torch.Generator, keep: tuple[str, ...] = ()) -> None:
    """Redraw `module`'s parameters (but those whose names start with `keep`) and its routers'
    selection biases (`_draw`), in named order from `g`."""
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if not pname.startswith(keep):
                p.copy_(_draw(pname, p.shape, g))
        for pname, b in module.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.copy_(_draw(pname, b.shape, g))


def _draw(pname: str, shape, g) -> torch.Tensor:
    if pname.endswith("norm.weight"):  # plain weights around 1 (GLM's RMSNorm multiplies by w)
        return 1 + 0.2 * torch.randn(shape, generator=g)
    if pname.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
        return 0.3 * torch.randn(shape, generator=g)
    if pname.endswith(("bias", "e_score_correction_bias")):
        return 0.1 * torch.randn(shape, generator=g)
    if pname.endswith("embed_tokens.weight") or pname == "lm_head.weight":
        return 0.3 * torch.randn(shape, generator=g)  # logits up to ~10: fp32 noise stays well under 1e-4
    fan_in = shape[-1]
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)


# --- HF -> GGUF (llama.cpp conversion/glm.py: Glm4MoeModel) -------------------------------------

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
          "hnorm.weight": "nextn.hnorm.weight", "post_norm.weight": "nextn.shared_head_norm.weight"}


def _layer_tensors(rest: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF (suffix -> tensor) of one HF decoder-layer tensor `rest`."""
    if rest == "mlp.experts.gate_up_proj":  # [E, 2·Fe, D]: gate rows first
        fe = w.shape[1] // 2
        return {"ffn_gate_exps.weight": w[:, :fe], "ffn_up_exps.weight": w[:, fe:]}
    return {_LAYER[rest]: w}


def moe_metadata(a: str, cfg) -> dict:
    """The `{a}.*` keys of a GLM MoE (sigmoid gating, expert groups) and the vocabulary size."""
    return {
        f"{a}.expert_count": cfg.n_routed_experts,
        f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_shared_count": cfg.n_shared_experts,
        f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{a}.leading_dense_block_count": cfg.first_k_dense_replace,
        f"{a}.expert_gating_func": 2,  # sigmoid
        f"{a}.expert_weights_scale": float(cfg.routed_scaling_factor),
        f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
        f"{a}.expert_group_count": cfg.n_group,
        f"{a}.expert_group_used_count": cfg.topk_group,
        f"{a}.vocab_size": cfg.vocab_size,
    }


def trunk_end(name: str, w: torch.Tensor, cfg, tensors: dict) -> bool:
    """Puts the embedding, final norm or (untied) LM head `name` into `tensors` under its GGUF
    name; False for any other tensor."""
    if name == "model.embed_tokens.weight":
        tensors["token_embd.weight"] = w
    elif name == "model.norm.weight":
        tensors["output_norm.weight"] = w
    elif name == "lm_head.weight":
        if not cfg.tie_word_embeddings:
            tensors["output.weight"] = w
    else:
        return False
    return True


def hf_to_gguf(model, mtp=None) -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's names and layout. `mtp`: a
    transformers MtpModel, or a state dict in its names (`layers.0.*`), or None."""
    cfg, a = model.config, "glm4moe"
    n_trunk = cfg.num_hidden_layers
    metadata = {
        f"{a}.block_count": n_trunk + (1 if mtp is not None else 0),
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.rope.dimension_count": int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]),
        f"{a}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        **moe_metadata(a, cfg),
    }
    if mtp is not None:
        metadata[f"{a}.nextn_predict_layers"] = 1
    tensors = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if not trunk_end(name, w, cfg, tensors):
            _, _, bid, rest = name.split(".", 3)
            for suffix, t in _layer_tensors(rest, w).items():
                tensors[f"blk.{bid}.{suffix}"] = t
    state = mtp.state_dict() if isinstance(mtp, torch.nn.Module) else (mtp or {})
    for name, w in state.items():
        if name.startswith(("embed_tokens.", "shared_head.")):  # the trunk's own (GLM-4.5 files omit copies)
            continue
        rest = name.removeprefix("layers.0.")
        if rest in _NEXTN:
            tensors[f"blk.{n_trunk}.{_NEXTN[rest]}"] = w.detach().clone()
        else:
            for suffix, t in _layer_tensors(rest.removeprefix("mtp_block."), w.detach().clone()).items():
                tensors[f"blk.{n_trunk}.{suffix}"] = t
    return a, metadata, tensors


def write_fixture(model, path, *, mtp=None, extra_metadata=None, extra_tensors=None, drop_tensors=(),
                  tensor_types=None) -> str:
    """Write `model` (+ its NextN block) as a GGUF at `path`; extra_* / drop_tensors make variants;
    tensor_types: GGUF name -> block type (`write_gguf`), the rest F32."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model, mtp)
    tensors = {k: v for k, v in {**tensors, **(extra_tensors or {})}.items() if k not in drop_tensors}
    return write_gguf(path, arch=arch, metadata={**metadata, **(extra_metadata or {})}, tensors=tensors,
                      tensor_types=tensor_types)


def nextn_reference(mtp, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """transformers' MTP layer 0 (`MtpModel.forward_layer`, no cache: every pair causal over the
    earlier ones) and its shared head: pair j is (hidden[j], tokens[j]) at positions[j].
    tokens int64 [T] (or [B, T]), hidden fp32 [T, D] ([B, T, D]), positions [T]
    -> (logits [T, V], h' [T, D]) (batched: [B, T, V], [B, T, D])."""
    batched = tokens.dim() == 2
    if not batched:
        tokens, hidden = tokens[None], hidden[None]
    position_ids = positions[None].expand(tokens.shape[0], -1)
    h_out = mtp.forward_layer(0, hidden, position_ids, None, input_ids=tokens)
    logits = mtp._project_to_logits(h_out)
    return (logits, h_out) if batched else (logits[0], h_out[0])


if __name__ == "__main__":
    import sys

    name, out = sys.argv[1:3]
    hf_model, hf_mtp = build_hf_model(name)
    print(write_fixture(hf_model, out, mtp=hf_mtp))
