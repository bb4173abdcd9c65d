"""Tiny random Gemma 4 targets with tiny random transformers assistants, both written to GGUF.

The HF -> GGUF map for the assistant is written here from llama.cpp's tensor names
(docs/reference/gemma4.md §2.4), independently of `verispec_gemma4_assistant.loader.TENSORS`, so
a wrong entry in either shows up as a parity failure.
"""
from __future__ import annotations

import numpy as np
import torch
from tiny_gemma import FL, S, TINY_GEMMA4_PLE, _layer_dims, make_hf_gemma4, write_gemma4_gguf

ARCH = "gemma4-assistant"
# E2B-like target: per-layer embeddings, KV sharing (sliding KV from layer 4, full from 3), 128
# ids so 16 centroids of 8 tokens divide them. The assistant has the centroid head and rope_freqs.
E_TARGET = {**TINY_GEMMA4_PLE, "vocab_size": 128, "vocab_size_per_layer_input": 128}
# 31B-like target: dense, K=V full layers with their own KV-head count (1 vs 2 on sliding layers),
# no PLE, no sharing (KV from the last layer of each type). Its assistant omits rope_freqs (the
# trunk's full-layer RoPE stands in).
DENSE_TARGET = {"vocab_size": 131, "hidden_size": 40, "intermediate_size": 37, "num_hidden_layers": 6,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
                "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
                "layer_types": [S, S, FL, S, S, FL], "hidden_size_per_layer_input": 0,
                "final_logit_softcapping": 3.0, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
PAIRS = {"e_style": (E_TARGET, True), "dense_31b_style": (DENSE_TARGET, False)}
NUM_CENTROIDS, CENTROID_TOP_K = 16, 4

ASSISTANT_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "pre_projection.weight": "mtp_pre_proj.weight",
    "post_projection.weight": "mtp_post_proj.weight",
    "masked_embedding.centroids.weight": "mtp_centroids.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    "model.layers.{i}.layer_scalar": "blk.{i}.layer_output_scale.weight",
}


def make_hf_assistant(target, *, centroids: bool, seed: int = 5, hidden_size: int = 24):
    """A seeded random Gemma4AssistantForCausalLM for `target` (eager): 4 layers, sliding x3 + full,
    its head dims and KV-head counts the target's; norms and layer scalars random too."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    tc = target.config
    head_dims, kv_heads = _layer_dims(tc)
    full = tc.layer_types.index(FL)
    text = Gemma4TextConfig(
        vocab_size=tc.vocab_size, hidden_size=hidden_size, intermediate_size=29, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=kv_heads[0], head_dim=head_dims[0], global_head_dim=head_dims[full],
        num_global_key_value_heads=kv_heads[full], attention_k_eq_v=kv_heads[full] != kv_heads[0],
        sliding_window=tc.sliding_window, layer_types=[S, S, S, FL], num_kv_shared_layers=4,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
        max_position_embeddings=512, rms_norm_eps=1e-6, attn_implementation="eager")
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                   use_ordered_embeddings=centroids, num_centroids=NUM_CENTROIDS,
                                   centroid_intermediate_top_k=CENTROID_TOP_K)
    model = Gemma4AssistantForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.15
            tensor.copy_(torch.randn(tensor.shape, generator=g) * scale)
        for name, tensor in model.named_buffers():
            if name.endswith("layer_scalar"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=g))
            elif name.endswith("token_ordering"):
                tensor.copy_(torch.randperm(tc.vocab_size, generator=g))
    return model


def assistant_gguf_tensors(assistant, target, *, rope_freqs: bool) -> dict:
    state = assistant.state_dict()
    out = {}
    for hf_name, gguf_name in ASSISTANT_HF_TO_GGUF.items():
        for i in range(4) if "{i}" in hf_name else [None]:
            key = hf_name.format(i=i)
            if key in state:
                out[gguf_name.format(i=i)] = state[key].detach().float()
    if "masked_embedding.token_ordering" in state:
        out["mtp_token_ordering.weight"] = state["masked_embedding.token_ordering"].numpy().astype(np.int32)
    if rope_freqs:
        tc = target.config
        full_dim = _layer_dims(tc)[0][tc.layer_types.index(FL)]
        angles = int(tc.rope_parameters["full_attention"]["partial_rotary_factor"] * full_dim // 2)
        out["rope_freqs.weight"] = torch.tensor([1.0] * angles + [1e30] * (full_dim // 2 - angles))
    return out


def assistant_gguf_metadata(assistant, *, arch: str = ARCH) -> dict:
    c = assistant.config
    tc = c.text_config
    head_dims, kv_heads = _layer_dims(tc)
    full = tc.layer_types.index(FL)
    md = {
        f"{arch}.embedding_length": tc.hidden_size,
        f"{arch}.embedding_length_out": c.backbone_hidden_size,
        f"{arch}.block_count": tc.num_hidden_layers,
        f"{arch}.context_length": tc.max_position_embeddings,
        f"{arch}.feed_forward_length": tc.intermediate_size,
        f"{arch}.attention.head_count": tc.num_attention_heads,
        f"{arch}.attention.head_count_kv": kv_heads if len(set(kv_heads)) > 1 else kv_heads[0],
        f"{arch}.attention.key_length": head_dims[full],
        f"{arch}.attention.value_length": head_dims[full],
        f"{arch}.attention.key_length_swa": head_dims[0],
        f"{arch}.attention.value_length_swa": head_dims[0],
        f"{arch}.attention.layer_norm_rms_epsilon": tc.rms_norm_eps,
        f"{arch}.attention.sliding_window": tc.sliding_window,
        f"{arch}.attention.sliding_window_pattern": np.array([t == S for t in tc.layer_types]),
        f"{arch}.rope.freq_base": tc.rope_parameters["full_attention"]["rope_theta"],
        f"{arch}.rope.freq_base_swa": tc.rope_parameters["sliding_attention"]["rope_theta"],
    }
    if c.use_ordered_embeddings:
        md[f"{arch}.centroid_top_k"] = c.centroid_intermediate_top_k
    return md


def write_assistant_gguf(path, assistant, target, *, arch: str = ARCH, rope_freqs: bool = True, drop=(),
                         extra_tensors=None, extra_metadata=None) -> str:
    from verispec.testing.fixture_writer import write_gguf

    tensors = {k: v for k, v in assistant_gguf_tensors(assistant, target, rope_freqs=rope_freqs).items()
               if k not in drop}
    tensors.update(extra_tensors or {})
    metadata = {**assistant_gguf_metadata(assistant, arch=arch), **(extra_metadata or {})}
    return write_gguf(path, arch=arch, metadata=metadata, tensors=tensors, vocab=None)


def make_pair(name, directory):
    """(hf target, hf assistant, trunk GGUF, assistant GGUF) for PAIRS[name]."""
    preset, centroids = PAIRS[name]
    target = make_hf_gemma4(preset)
    assistant = make_hf_assistant(target, centroids=centroids)
    trunk_path = write_gemma4_gguf(directory / "trunk.gguf", target)
    assistant_path = write_assistant_gguf(directory / "assistant.gguf", assistant, target, rope_freqs=centroids)
    return target, assistant, trunk_path, assistant_path


def hf_target_outputs(target, ids: torch.Tensor):
    """transformers' target over ids [p] (no cache): .shared_kv_states holds every position's K/V."""
    with torch.no_grad():
        return target(ids[None], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)


def hf_step(assistant, target, outputs, token: int, hidden: torch.Tensor, pos: int):
    """transformers' assistant step as its candidate generator calls it: (logits [V], h_next [D])."""
    with torch.no_grad():
        embedding = target.model.embed_tokens(torch.tensor([[token]]))
        out = assistant(inputs_embeds=torch.cat([embedding, hidden.view(1, 1, -1)], dim=-1),
                        position_ids=torch.tensor([[pos]]), attention_mask=torch.ones(1, pos + 1, dtype=torch.long),
                        shared_kv_states=outputs.shared_kv_states, use_cache=False)
    return out.logits[0, 0], out.last_hidden_state[0, 0]
