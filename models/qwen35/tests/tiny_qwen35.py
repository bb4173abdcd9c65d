"""Tiny random Qwen 3.5 models in transformers, written to GGUF as llama.cpp's converter would.

`build_hf_model(name)` builds the seeded transformers model of `TINY_CONFIGS[name]` and,
when `mtp=True`, a random MTP block in HF's `mtp.*` names (transformers drops MTP weights on
load, so they are drawn here). `hf_to_gguf` is the HF -> GGUF map written from llama.cpp's
converter naming (docs/reference/qwen35.md §3, §4: `conversion/qwen.py`), independently of the
loader's table: norms +1 except `linear_attn.norm`, A_log -> -exp(A_log), conv1d squeezed,
value heads re-tiled, experts' gate_up split, MTP renamed onto `blk.{L}`.
Sizes are odd and distinct (nv != nk so the re-tiling matters, dk != dv so a transposed
state cannot pass).
"""
from __future__ import annotations

import math

import torch

_COMMON = {
    "vocab_size": 131, "hidden_size": 48, "num_hidden_layers": 4, "num_attention_heads": 3,
    "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
    "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False,
}
#: name -> (HF model_type, GGUF architecture, config kwargs, extra GGUF options)
TINY_CONFIGS = {
    "dense": ("qwen3_5_text", "qwen35", {**_COMMON, "intermediate_size": 37}, {}),
    "dense_mtp": ("qwen3_5_text", "qwen35", {**_COMMON, "intermediate_size": 37}, {"mtp": True}),
    "dense_tied": ("qwen3_5_text", "qwen35", {**_COMMON, "intermediate_size": 41, "tie_word_embeddings": True,
                                              "vocab_size": 137}, {}),
    "moe": ("qwen3_5_moe_text", "qwen35moe", {**_COMMON, "num_experts": 5, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": 19,
                                              "shared_expert_intermediate_size": 23}, {}),
    # fused ffn_gate_up_exps and a 2-D shared-expert gate [1, D], with MTP
    "moe_fused_mtp": ("qwen3_5_moe_text", "qwen35moe", {**_COMMON, "num_experts": 5, "num_experts_per_tok": 2,
                                                        "moe_intermediate_size": 19,
                                                        "shared_expert_intermediate_size": 23},
                      {"mtp": True, "fuse_gate_up": True, "shexp_2d": True}),
    # conformance: core GatedMLP's silu is batch-invariant only over whole SIMD blocks, so the
    # FFN widths it sees are multiples of 64 (as in real checkpoints); everything else stays odd
    "dense_conf": ("qwen3_5_text", "qwen35", {**_COMMON, "intermediate_size": 128}, {}),
    "moe_conf": ("qwen3_5_moe_text", "qwen35moe", {**_COMMON, "num_experts": 5, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 19,
                                                   "shared_expert_intermediate_size": 64}, {}),
    # the benchmark fixture: a forward costs >= 5 ms on a CPU core
    "bench": ("qwen3_5_text", "qwen35", {**_COMMON, "vocab_size": 2048, "hidden_size": 320,
                                         "num_hidden_layers": 12, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "head_dim": 64,
                                         "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                         "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                                         "intermediate_size": 864, "max_position_embeddings": 4096},
              {"mtp": True}),
}


def build_hf_model(name: str, seed: int = 0):
    """(the seeded transformers model fp32 eager, its MTP state dict in HF names or None).

    Weights are redrawn at ~unit gain (the 0.02 init gives near-uniform logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, kwargs, options = TINY_CONFIGS[name]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    # transformers' grouped_mm experts need 16-byte-aligned strides; the eager loop does not
    experts = {"experts_implementation": "eager"} if "moe" in model_type else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                             **experts).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(_draw(pname, p.shape, g))
    mtp = _draw_mtp(model, g) if options.get("mtp") else None
    return model, mtp


def _draw(pname: str, shape, g) -> torch.Tensor:
    if pname.endswith("linear_attn.norm.weight"):  # plain weight around 1
        return 1 + 0.2 * torch.randn(shape, generator=g)
    if pname.endswith("norm.weight"):  # zero-centred in HF: the model multiplies by 1 + w
        return 0.2 * torch.randn(shape, generator=g)
    if pname.endswith("A_log"):
        return torch.empty(shape).uniform_(-1.0, 1.0, generator=g)
    if pname.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=g)
    if pname.endswith("conv1d.weight"):
        return 0.5 * torch.randn(shape, generator=g)
    if pname.endswith("embed_tokens.weight") or pname == "lm_head.weight":
        return 0.3 * torch.randn(shape, generator=g)  # logits up to ~9: fp32 noise stays well under 1e-4
    fan_in = shape[-1]
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)


def _draw_mtp(model, g) -> dict[str, torch.Tensor]:
    """A random MTP block in HF names: mtp.fc, three norms, layers.0 shaped like a full-attention layer."""
    d = model.config.hidden_size
    full = model.config.layer_types.index("full_attention")
    out = {"mtp.fc.weight": torch.randn(d, 2 * d, generator=g) / math.sqrt(2 * d)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = 0.2 * torch.randn(d, generator=g)
    for name, p in model.model.layers[full].state_dict().items():
        out[f"mtp.layers.0.{name}"] = _draw(name, p.shape, g)
    return out


# --- HF -> GGUF (llama.cpp conversion/qwen.py: Qwen3NextModel / _LinearAttentionVReorderBase) ---

_ATTN = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def tiled_order(nk: int, nv: int) -> torch.Tensor:
    """GGUF v-head p holds HF (grouped) v-head (p % nk) · r + p // nk (docs/reference/qwen35.md §4.6)."""
    r = nv // nk
    return torch.tensor([(p % nk) * r + p // nk for p in range(nv)])


def _retile(w: torch.Tensor, order: torch.Tensor, head_size: int, dim: int = 0) -> torch.Tensor:
    """Permute value heads (blocks of head_size along dim) into tiled order."""
    blocks = w.unflatten(dim, (len(order), head_size))
    return blocks.index_select(dim, order).flatten(dim, dim + 1)


def _layer_tensors(cfg, rest: str, w: torch.Tensor, options) -> dict[str, torch.Tensor]:
    """GGUF (suffix -> tensor) of one HF layer tensor `rest`."""
    order = tiled_order(cfg.linear_num_key_heads, cfg.linear_num_value_heads)
    key_dim, dv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if rest.endswith("norm.weight") and not rest.startswith("linear_attn.norm"):
        w = w + 1
    if rest == "linear_attn.in_proj_qkv.weight":
        w = torch.cat([w[:2 * key_dim], _retile(w[2 * key_dim:], order, dv)])
    elif rest == "linear_attn.conv1d.weight":
        w = w.squeeze(1)
        w = torch.cat([w[:2 * key_dim], _retile(w[2 * key_dim:], order, dv)])
    elif rest == "linear_attn.in_proj_z.weight":
        w = _retile(w, order, dv)
    elif rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        w = _retile(w, order, 1)
    elif rest == "linear_attn.A_log":
        w = -_retile(w, order, 1).exp()
    elif rest == "linear_attn.out_proj.weight":
        w = _retile(w, order, dv, dim=1)
    elif rest == "mlp.experts.gate_up_proj":  # [E, 2·ff, D]: gate rows first
        if options.get("fuse_gate_up"):
            return {"ffn_gate_up_exps.weight": w}
        ff = w.shape[1] // 2
        return {"ffn_gate_exps.weight": w[:, :ff], "ffn_up_exps.weight": w[:, ff:]}
    elif rest == "mlp.shared_expert_gate.weight" and not options.get("shexp_2d"):
        w = w.reshape(-1)  # llama.cpp keeps [D]
    return {_ATTN[rest]: w}


def hf_to_gguf(model, mtp=None, options=None) -> tuple[str, dict, dict]:
    """(arch, metadata, tensors) for `write_gguf`, in llama.cpp's names and layout."""
    options = options or {}
    cfg = model.config
    arch = "qwen35moe" if cfg.model_type.startswith("qwen3_5_moe") else "qwen35"
    n_main = cfg.num_hidden_layers
    a = arch
    metadata = {
        f"{a}.block_count": n_main + (1 if mtp else 0),
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{a}.rope.dimension_count": int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]),
        f"{a}.rope.dimension_sections": [11, 11, 10, 0],
        f"{a}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{a}.ssm.state_size": cfg.linear_key_head_dim,
        f"{a}.ssm.group_count": cfg.linear_num_key_heads,
        f"{a}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{a}.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        # every layer_types[i] of a tiny config is full iff (i + 1) % interval == 0 (the loader's rule)
        f"{a}.full_attention_interval": cfg.layer_types.index("full_attention") + 1,
    }
    if mtp:
        metadata[f"{a}.nextn_predict_layers"] = 1
    if arch == "qwen35":
        metadata[f"{a}.feed_forward_length"] = cfg.intermediate_size
    else:
        metadata.update({f"{a}.expert_count": cfg.num_experts,
                         f"{a}.expert_used_count": cfg.num_experts_per_tok,
                         f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
                         f"{a}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size})
    tensors = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w + 1
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                tensors["output.weight"] = w
        else:
            _, _, bid, rest = name.split(".", 3)
            for suffix, t in _layer_tensors(cfg, rest, w, options).items():
                tensors[f"blk.{bid}.{suffix}"] = t
    for name, w in (mtp or {}).items():
        top = {"mtp.fc.weight": "nextn.eh_proj.weight",
               "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
               "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
               "mtp.norm.weight": "nextn.shared_head_norm.weight"}
        if name in top:
            tensors[f"blk.{n_main}.{top[name]}"] = w + 1 if "norm" in name else w
        else:
            rest = name.removeprefix("mtp.layers.0.")
            for suffix, t in _layer_tensors(cfg, rest, w, options).items():
                tensors[f"blk.{n_main}.{suffix}"] = t
    return arch, metadata, tensors


def write_fixture(model, path, *, mtp=None, options=None, extra_metadata=None, extra_tensors=None,
                  drop_tensors=()) -> str:
    """Write `model` (+ its MTP block) as a GGUF at `path`; extra_* / drop_tensors make variants."""
    from verispec.testing.fixture_writer import write_gguf

    arch, metadata, tensors = hf_to_gguf(model, mtp, options)
    tensors = {k: v for k, v in {**tensors, **(extra_tensors or {})}.items() if k not in drop_tensors}
    return write_gguf(path, arch=arch, metadata={**metadata, **(extra_metadata or {})}, tensors=tensors)


class HfMtpReference(torch.nn.Module):
    """The MTP block rebuilt from transformers' own modules (decoder layer, zero-centred RMSNorm,
    rotary embedding; the trunk's embedding and LM head), in HF's `mtp.*` names: the independent
    reference for the draft head, and a differentiable copy to train (`mtp_state_dict()` goes
    back through `hf_to_gguf`).

    forward(tokens int64 [T], hidden fp32 [T, D], positions int64 [T]): pair j is (hidden[j],
    tokens[j]) at positions[j], all causal over each other; returns (logits [T, V], h' [T, D]).
    """

    def __init__(self, hf_model, mtp: dict[str, torch.Tensor]):
        super().__init__()
        cfg = hf_model.config
        self.hf = [hf_model]  # not a submodule: its weights are not trained here
        full = cfg.layer_types.index("full_attention")
        norm_cls = type(hf_model.model.norm)
        d = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm_cls(d, eps=cfg.rms_norm_eps)
                                                                          for _ in range(3))
        self.layers = torch.nn.ModuleList([type(hf_model.model.layers[full])(cfg, full)])
        self.load_state_dict({k.removeprefix("mtp."): v for k, v in mtp.items()})

    def mtp_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v.detach().clone() for k, v in self.state_dict().items()}

    def forward(self, tokens, hidden, positions):
        """Also batched: tokens [B, T], hidden [B, T, D], positions [T] -> [B, T, V], [B, T, D]."""
        hf, batched = self.hf[0], tokens.dim() == 2
        if not batched:
            tokens, hidden = tokens[None], hidden[None]
        e = hf.model.embed_tokens(tokens)  # [B, T, D]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos_sin = hf.model.rotary_emb(x, positions[None])
        t = tokens.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask)
        h_out = self.norm(x)
        logits = hf.lm_head(h_out)
        return (logits, h_out) if batched else (logits[0], h_out[0])
