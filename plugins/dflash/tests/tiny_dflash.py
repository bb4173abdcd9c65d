"""Tiny random reference drafters (`dflash==0.1.0`: DFlashDraftModel / DFlash2DraftModel) and a tiny
llama target, written to GGUF by our writers and loaded back by our loaders.

`make_drafter(variant, ...)` builds a seeded reference drafter of one of `VARIANTS` (generation,
causality, window, layer types, conv/selector switches) sized for `TARGET` (hidden 48, 4 layers,
vocabulary 131). Oracle quirks handled here (reference note errata 8): `base_kernel` is
`torch.empty` in the reference and is set explicitly; `num_target_layers` is given even with
explicit taps; `use_sliding_window=True` with explicit `layer_types` keeps `sliding_window`.
"""
from __future__ import annotations

import math

import torch

#: the tiny target: a transformers llama config (untied head), 4 layers so taps can sit inside it.
TARGET = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 4,
          "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
MASK_ID = 130  # the last id of the target vocabulary ("<unused…>" padding in the byte-level vocab)

#: name -> reference config choices. window: W of the sliding layers; layer_types None = all of
#: one kind (sliding when window is set). conv / selector: DFlash2 sizes (None = DFlash1).
VARIANTS = {
    "d1_noncausal": dict(causal=False),
    "d1_causal_window": dict(causal=True, window=6),
    "d1_noncausal_window_mixed": dict(causal=False, window=7, layer_types=("sliding_attention", "full_attention")),
    "d1_default_causality_window": dict(causal=None, window=8),  # reference rule: all-sliding => causal
    "d2_noncausal": dict(causal=False, generation=2),
    "d2_causal_window": dict(causal=True, window=6, generation=2),
    "d2_noncausal_window": dict(causal=False, window=7, generation=2, logit_scale=0.7, softcap=9.0),
}


def build_target(seed: int = 0, **overrides):
    """The seeded transformers LlamaForCausalLM of TARGET (with `overrides`), fp32, weights at ~unit gain
    (tiny_llama's recipe)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_llama import redraw_unit_gain

    config = AutoConfig.for_model("llama", **{**TARGET, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    return redraw_unit_gain(model, seed)


def make_drafter(variant: str = "d1_noncausal", *, seed: int = 0, hf_taps=(0, 2), num_layers: int = 2,
                 block_size: int = 6, identity_conv: bool = False, zero_selector: bool = False,
                 hidden_size: int = TARGET["hidden_size"], vocab_size: int = TARGET["vocab_size"]):
    """A seeded random reference drafter of VARIANTS[variant] (eval mode, fp32).

    hf_taps: HF `target_layer_ids` (outputs of those target layers; GGUF taps are +1).
    identity_conv: base tap 0 = 1, other taps 0, projections 0 (the Speculators trainer's init:
    conv = identity). zero_selector: hidden_projection P = 0 (the walk reduces to argmax)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    v = dict(VARIANTS[variant])
    generation = v.pop("generation", 1)
    window = v.pop("window", None)
    layer_types = v.pop("layer_types", None)
    if layer_types is None:
        layer_types = ("sliding_attention" if window else "full_attention",) * num_layers
    dflash_config = {"target_layer_ids": list(hf_taps), "block_size": block_size, "mask_token_id": MASK_ID}
    if "logit_scale" in v:
        dflash_config["output_multiplier"] = v.pop("logit_scale")
    if "softcap" in v:
        dflash_config["final_logit_softcapping"] = v.pop("softcap")
    if generation == 2:
        dflash_config.update(conv_kernel_size=3, conv_group_size=4, selector_rank=6, selector_top_k=4)
    causal = v.pop("causal")
    assert not v, v
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=29, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, attention_bias=False,
        use_sliding_window=window is not None, sliding_window=window, max_window_layers=0,
        layer_types=list(layer_types), num_target_layers=TARGET["num_hidden_layers"], dflash_config=dflash_config)
    if causal is not None:
        config.is_causal = causal
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if generation == 2 else DFlashDraftModel)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif name.endswith("base_kernel"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
                if identity_conv:
                    p.zero_()
                    p[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
                if identity_conv:
                    p.zero_()
            else:  # [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
                if zero_selector and name.endswith("hidden_projection.weight"):
                    p.zero_()
    return model
