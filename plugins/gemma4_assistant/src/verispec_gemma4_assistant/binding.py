"""Whether an assistant can draft for a trunk: `binding_problem(config, trunk)` -> why not, or None.

The assistant reads the trunk's embedding, hidden rows and K/V, so it must be the one trained
for that trunk's sizes: a Gemma 4 trunk (it reads the last non-shared sliding and full layers'
K/V), D = its `embedding_length_out`, the same vocabulary, the same head dims and KV-head
counts per layer type, and a trunk ring that holds the assistant's window + 1 positions.
"""
from __future__ import annotations

from verispec_gemma4.modeling_gemma4 import SLIDING, Gemma4Config

from verispec_gemma4_assistant.config import AssistantConfig

FIX = "pass the assistant released with this model (--draft-model)"


def kv_layer(trunk_config: Gemma4Config, layer_type: str) -> int | None:
    """The trunk layer whose K/V the assistant's `layer_type` layers read: the last layer of
    that type computing K/V (before the KV-shared ones); None when there is none."""
    own = [i for i in range(trunk_config.first_kv_shared_layer) if trunk_config.layer_types[i] == layer_type]
    return own[-1] if own else None


def binding_problem(config: AssistantConfig, trunk) -> str | None:
    """Why the assistant of `config` cannot draft for `trunk`, naming the first difference and the fix; None when it can."""
    tc = getattr(trunk, "config", None)
    if not isinstance(tc, Gemma4Config):
        return (f"a Gemma 4 assistant drafts for a Gemma 4 trunk, and the model is {type(trunk).__name__}; "
                "serve the Gemma 4 model the assistant belongs to")
    if config.backbone_hidden_size != tc.hidden_size:
        return (f"the assistant reads {config.backbone_hidden_size}-wide trunk rows (embedding_length_out), the "
                f"trunk's hidden size is {tc.hidden_size}; {FIX}")
    if config.vocab_size != tc.vocab_size:
        return f"the assistant's vocabulary has {config.vocab_size} ids, the trunk's {tc.vocab_size}; {FIX}"
    for i, kind in enumerate(config.layer_types):
        source = kv_layer(tc, kind)
        what = "sliding" if kind == SLIDING else "full"
        if source is None:
            return f"assistant layer {i} attends a {what} layer's K/V and the trunk has no {what} layer; {FIX}"
        ours, theirs = config.layer_head_dim(i), tc.layer_head_dim(source)
        if ours != theirs:
            return (f"assistant layer {i} has {what}-layer head dim {ours}, the trunk's {what} layers {theirs}; "
                    f"{FIX}")
        kv_heads = tc.num_key_value_heads[source]
        if config.num_key_value_heads[i] != kv_heads or config.num_attention_heads % kv_heads:
            return (f"assistant layer {i} groups {config.num_attention_heads} query heads over "
                    f"{config.num_key_value_heads[i]} KV heads, the trunk's {what} layer {source} has {kv_heads}; "
                    f"{FIX}")
    ring = tc.sliding_window + getattr(trunk, "ring_rows", 2) - 1
    if SLIDING in config.layer_types and config.sliding_window + 1 > ring:
        return (f"the assistant's sliding layers see {config.sliding_window + 1} positions and the trunk's "
                f"sliding-window ring keeps {ring} (window {tc.sliding_window}); {FIX}")
    return None
