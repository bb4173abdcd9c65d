"""Write a reference drafter (`dflash.model` DFlashDraftModel / DFlash2DraftModel, or any module with
its config and state-dict names) as a `dflash` GGUF with llama.cpp mainline's names and keys.

Conventions of the mainline converter (`conversion/qwen.py` DFlashModel; reference note §5.2, §5.5):
- `dflash.target_layers` = HF `target_layer_ids` + 1 (HF numbers a tap as the output of layer t,
  GGUF as the residual entering layer t + 1);
- norms stored raw (the converter derives from Qwen3Model: no +1);
- the mask id under `tokenizer.ggml.mask_token_id`; the target's tokenizer copied (`vocab`);
- conv bases without `.weight`, codebooks with it.
Causality: `dflash.attention.causal` from the config's top-level `is_causal`; when that is None and
every layer has the same type, the reference's rule (sliding layers causal) is written out; a
drafter mixing layer types without `is_causal` gets no key (the loader then refuses it).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base", "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base", "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_GLOBAL = {
    "fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "candidate_selector.predecessor_codebook.weight": "selector_predecessor.weight",
    "candidate_selector.successor_codebook.weight": "selector_successor.weight",
}


def _draft_value(config, name, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def dflash_tensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """HF state dict (torch tensors) -> GGUF name -> tensor (torch order). Raises KeyError for a name it does not map."""
    out = {}
    for name, tensor in state_dict.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            out[f"blk.{i}.{_LAYER[rest]}"] = tensor.detach().float()
        elif name in _GLOBAL:
            out[_GLOBAL[name]] = tensor.detach().float()
        elif "rotary_emb" not in name:
            raise KeyError(f"no GGUF name for drafter parameter {name!r}")
    return out


def dflash_metadata(model) -> dict[str, Any]:
    """The `dflash.*` keys and `tokenizer.ggml.mask_token_id` of a reference drafter `model`."""
    c = model.config
    A = "dflash."
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = {
        A + "block_count": c.num_hidden_layers, A + "embedding_length": c.hidden_size,
        A + "feed_forward_length": c.intermediate_size, A + "attention.head_count": c.num_attention_heads,
        A + "attention.head_count_kv": c.num_key_value_heads, A + "attention.key_length": head_dim,
        A + "attention.value_length": head_dim, A + "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        A + "rope.freq_base": float(theta), A + "context_length": int(c.max_position_embeddings),
        A + "block_size": int(model.block_size),
        A + "target_layers": [int(t) + 1 for t in model.target_layer_ids],
        "tokenizer.ggml.mask_token_id": int(model.mask_token_id),
    }
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding):
        meta[A + "attention.sliding_window"] = int(c.sliding_window)
        meta[A + "attention.sliding_window_pattern"] = np.array(sliding, dtype=np.bool_)
    causal = getattr(c, "is_causal", None)
    if causal is None and len(set(sliding)) == 1:
        causal = sliding[0]
    if causal is not None:
        meta[A + "attention.causal"] = bool(causal)
    for hf, key in (("output_multiplier", "logit_scale"), ("final_logit_softcapping", "final_logit_softcapping"),
                    ("input_embedding_scale", "embedding_scale")):
        value = _draft_value(c, hf)
        if value is not None:
            meta[A + key] = float(value)
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = _draft_value(c, name)
        if value is not None and hasattr(model, "candidate_selector"):
            meta[A + name] = int(value)
    return meta


def write_dflash_gguf(path: str | os.PathLike, model, *, vocab: Mapping[str, Any] | None,
                      extra_metadata: Mapping[str, Any] | None = None, drop: tuple[str, ...] = (),
                      extra_tensors: Mapping[str, Any] | None = None, quantize: str | None = None) -> str:
    """Write `model` to `path`; returns the path. vocab: the target's `tokenizer.*` keys (copied, as
    the converter does from --target-model-dir) or None. extra_metadata / drop / extra_tensors make
    variants (keys added or overridden; GGUF tensor names left out; tensors added). quantize: a
    GGUF type ("Q8_0", "F16") for every 2-D tensor whose rows are whole 32-column blocks (norms,
    conv bases and narrower tensors stay F32); None: all F32."""
    from verispec.testing.fixture_writer import write_gguf

    tensors = {k: v for k, v in dflash_tensors(model.state_dict()).items() if k not in drop}
    tensors.update(extra_tensors or {})
    metadata = {**dflash_metadata(model), **(extra_metadata or {})}
    metadata = {k: v for k, v in metadata.items() if v is not None}
    types = {name: quantize for name, t in tensors.items()
             if quantize and t.dim() == 2 and t.shape[-1] % 32 == 0 and not name.endswith("_base")}
    return write_gguf(path, arch="dflash", metadata=metadata, tensors=tensors, vocab=dict(vocab) if vocab else None,
                      tensor_types=types)
