"""The GGUF contract of a DFlash/DFlash2 drafter: `DFlashConfig.from_gguf(metadata, shapes, source)`.

Keys and tensors follow llama.cpp mainline (`conversion/qwen.py` DFlashModel, `src/models/dflash.cpp`):
reference note §5.1 (keys), §5.2 (tensors), §5.3 (generation), with its errata. `A` = `dflash`.

- Generation: DFlash2 iff every `blk.N.{attn,ffn}_conv_{base,proj}` tensor, the three
  `selector_*` tensors and the four conv/selector keys are present; partial presence is refused
  naming what is missing (llama.cpp treats them as one unit too).
- Taps: `A.target_layers` L = the residual entering 0-based target layer L (mainline writes HF's
  `target_layer_ids` + 1); the trunk's `Segment.tap_layers` numbering, as is.
- Causality: `A.attention.causal` (default false, llama.cpp's). A file mixing sliding-window and
  full layers without the key is refused: the torch reference makes only its sliding layers
  causal then, which one global bool cannot say (errata 2).
- Logit transform: the drafter's own `A.logit_scale` / `A.final_logit_softcapping`, identity when
  absent (errata 3: no reference inherits the target's).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import attrs
import numpy as np
from verispec.gguf.io import arch_value

from verispec_dflash.errors import MalformedDFlash, NotADFlashDrafter, UnsupportedDFlash

log = logging.getLogger(__name__)

ARCH = "dflash"

#: per-layer tensors every generation has, with their torch shapes as functions of the config.
LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
                 "ffn_up.weight", "ffn_down.weight")
GLOBAL_TENSORS = ("fc.weight", "enc.output_norm.weight", "output_norm.weight")
#: DFlash2's per-layer conv tensors (the bases have no `.weight` suffix) and global selector tensors.
CONV_TENSORS = ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
SELECTOR_TENSORS = ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

#: keys of other schemas sharing the `dflash` architecture (DSpark, forks' backbones).
OTHER_SCHEMA_KEYS = ("sample_from_anchor", "has_confidence_head", "decoder_arch", "hc_mult")
#: tensors of other schemas (DSpark's Markov and confidence heads).
OTHER_SCHEMA_TENSORS = ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias")
#: optional tensors refused until supported, each with its reason (note §5.2).
UNSUPPORTED_TENSORS = {
    r"blk\.\d+\.attn_(q|k|v|output)\.bias": "attention biases (gpt-oss-style drafts)",
    r"blk\.\d+\.attn_sinks(\.weight)?": "attention sinks",
    r"fc\.scale": "a scaled fc",
    r"d2t(\.weight)?": "a reduced draft vocabulary (d2t)",
    r"(token_embd|output)\.weight": "a draft-owned embedding or LM head (DFlash borrows the target's)",
}


@attrs.frozen
class DFlashConfig:
    """Sizes and switches of one drafter. Units: counts of rows/heads/layers; eps and rope_theta plain floats."""

    hidden_size: int  # H (= the target's)
    num_layers: int  # Ld
    intermediate_size: int  # F
    num_heads: int  # n_h
    num_kv_heads: int  # n_kv
    head_dim: int  # d
    rms_eps: float
    rope_theta: float
    #: W, or None when no layer is sliding-window.
    sliding_window: int | None
    #: per layer: True = sliding-window (ring of W rows), False = full (linear cache).
    sliding_layers: tuple[bool, ...]
    causal: bool
    #: target layers whose entering residuals are fused (Segment.tap_layers numbering).
    target_layers: tuple[int, ...]
    #: width of one tapped target row (fc.weight columns / len(target_layers)).
    target_hidden_size: int
    block_size: int  # B
    mask_token_id: int
    logit_scale: float = 1.0
    #: c of c·tanh(ℓ/c); None = no softcap.
    softcap: float | None = None
    embedding_scale: float = 1.0
    #: 2 for DFlash2 (conv + selector), else 1.
    generation: int = 1
    conv_kernel_size: int = 0  # KS
    conv_group_size: int = 0  # gs
    selector_rank: int = 0  # R
    selector_top_k: int = 0  # K
    #: V of the selector codebooks (DFlash2), checked against the target head.
    selector_vocab_size: int = 0

    @property
    def conv_groups(self) -> int:
        """G = H / gs."""
        return self.hidden_size // self.conv_group_size if self.conv_group_size else 0

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> torch shape, for every tensor this config's math reads."""
        H, d, F = self.hidden_size, self.head_dim, self.intermediate_size
        shapes = {"fc.weight": (H, len(self.target_layers) * self.target_hidden_size),
                  "enc.output_norm.weight": (H,), "output_norm.weight": (H,)}
        for i in range(self.num_layers):
            b = f"blk.{i}."
            shapes.update({b + "attn_norm.weight": (H,), b + "attn_q.weight": (self.num_heads * d, H),
                           b + "attn_k.weight": (self.num_kv_heads * d, H), b + "attn_v.weight": (self.num_kv_heads * d, H),
                           b + "attn_output.weight": (H, self.num_heads * d), b + "attn_q_norm.weight": (d,),
                           b + "attn_k_norm.weight": (d,), b + "ffn_norm.weight": (H,),
                           b + "ffn_gate.weight": (F, H), b + "ffn_up.weight": (F, H), b + "ffn_down.weight": (H, F)})
            if self.generation == 2:
                KS, G = self.conv_kernel_size, self.conv_groups
                for side in ("attn", "ffn"):
                    shapes[f"{b}{side}_conv_base"] = (2, KS, H)
                    shapes[f"{b}{side}_conv_proj.weight"] = (2 * KS * G, H)
        if self.generation == 2:
            R, V = self.selector_rank, self.selector_vocab_size
            shapes.update({"selector_hidden.weight": (R, H), "selector_predecessor.weight": (V, R),
                           "selector_successor.weight": (V, R)})
        return shapes

    @classmethod
    def from_gguf(cls, metadata: Mapping, shapes: Mapping[str, tuple[int, ...]], *, source: str) -> DFlashConfig:
        """Read the keys and tensor shapes of a `dflash` GGUF.

        shapes: GGUF tensor name -> torch-order shape. Raises NotADFlashDrafter (DSpark/fork
        schemas), UnsupportedDFlash (features not implemented: named), MalformedDFlash (keys and
        tensors that contradict each other, partial DFlash2), gguf.errors.MissingKey (a required key).
        """
        _refuse_other_schemas(metadata, shapes, source)
        _refuse_unsupported_tensors(shapes, source)

        def key(suffix, default=...):
            return arch_value(metadata, suffix, default, source=source)

        H, Ld = int(key("embedding_length")), int(key("block_count"))
        n_h, n_kv = int(key("attention.head_count")), int(key("attention.head_count_kv"))
        if n_h <= 0 or n_kv <= 0 or n_h % n_kv:
            raise MalformedDFlash(source, f"{n_h} query heads cannot be grouped over {n_kv} KV heads")
        d_k, d_v = key("attention.key_length", None), key("attention.value_length", None)
        d = int(d_k if d_k is not None else H // n_h)
        if d_v is not None and int(d_v) != d:
            raise UnsupportedDFlash(source, f"key length {d} != value length {d_v}", "DFlash drafters have equal K/V dims")
        _check_rope(key, d, source)
        window = key("attention.sliding_window", None)
        window = int(window) if window else None
        sliding = _sliding_layers(key, window, Ld, source)
        causal_key = key("attention.causal", None)
        if causal_key is None and window is not None and len(set(sliding)) > 1:
            raise UnsupportedDFlash(source, "sliding-window and full layers mixed without dflash.attention.causal "
                                    "(the reference makes only its sliding layers causal then)",
                                    "re-convert writing dflash.attention.causal")
        taps = tuple(int(t) for t in np.asarray(key("target_layers")).reshape(-1).tolist())
        if not taps:
            raise MalformedDFlash(source, "dflash.target_layers is empty")
        if "dflash.target_hidden_size" in metadata:
            log.warning("%s carries dflash.target_hidden_size (a pre-merge converter): its taps may be one layer "
                        "early; re-convert with llama.cpp mainline", source)
        B = int(key("block_size"))
        mask = metadata.get("tokenizer.ggml.mask_token_id", metadata.get(f"{ARCH}.mask_token_id"))
        if mask is None:
            raise MalformedDFlash(source, "no mask token id (tokenizer.ggml.mask_token_id)")
        if B < 2:
            raise MalformedDFlash(source, f"block size {B}: a block needs the anchor and at least one mask row")
        if window is not None and B > window:
            raise MalformedDFlash(source, f"block size {B} exceeds the sliding window {window}")
        fc = shapes.get("fc.weight")
        if fc is None or len(fc) != 2 or fc[1] % len(taps):
            raise MalformedDFlash(source, f"fc.weight {fc} does not take {len(taps)} concatenated taps")
        softcap = key("final_logit_softcapping", None)
        fields = dict(
            hidden_size=H, num_layers=Ld, intermediate_size=int(key("feed_forward_length")), num_heads=n_h,
            num_kv_heads=n_kv, head_dim=d, rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base")), sliding_window=window, sliding_layers=sliding,
            causal=bool(causal_key) if causal_key is not None else False, target_layers=taps,
            target_hidden_size=fc[1] // len(taps), block_size=B, mask_token_id=int(mask),
            logit_scale=float(key("logit_scale", 1.0)),
            softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            embedding_scale=float(key("embedding_scale", 1.0)))
        fields.update(_dflash2_fields(metadata, shapes, Ld, H, source))
        config = cls(**fields)
        _check_tensors(config, shapes, source)
        return config


def _refuse_other_schemas(metadata, shapes, source):
    keys = [f"{ARCH}.{k}" for k in OTHER_SCHEMA_KEYS if f"{ARCH}.{k}" in metadata]
    tensors = [t for t in OTHER_SCHEMA_TENSORS if t in shapes]
    if keys or tensors:
        raise NotADFlashDrafter(source, f"it carries {', '.join(keys + tensors)} (DSpark or a fork's schema)")


def _refuse_unsupported_tensors(shapes, source):
    for name in shapes:
        for pattern, what in UNSUPPORTED_TENSORS.items():
            if re.fullmatch(pattern, name):
                raise UnsupportedDFlash(source, f"{name}: {what} is not supported yet",
                                        "use a drafter without it")


def _check_rope(key, d, source):
    n_rot = key("rope.dimension_count", None)
    if n_rot is not None and int(n_rot) != d:
        raise UnsupportedDFlash(source, f"partial RoPE ({n_rot} of {d} dims)", "only full-head NEOX RoPE is supported")
    scaling = key("rope.scaling.type", None)
    if scaling not in (None, "", "none"):
        raise UnsupportedDFlash(source, f"RoPE scaling {scaling!r}", "only plain RoPE is supported yet")
    sections = key("rope.dimension_sections", None)
    if sections is not None:
        sections = [int(s) for s in np.asarray(sections).reshape(-1).tolist()]
        if sections[:1] != [d // 2] or any(sections[1:]):
            raise UnsupportedDFlash(source, f"M-RoPE sections {sections}",
                                    f"only [{d // 2}, 0, 0, 0] (plain RoPE at the token position) is supported")


def _sliding_layers(key, window, num_layers, source) -> tuple[bool, ...]:
    if window is None:
        return (False,) * num_layers
    pattern = key("attention.sliding_window_pattern", None)
    if pattern is None:
        raise MalformedDFlash(source, "dflash.attention.sliding_window without dflash.attention.sliding_window_pattern")
    pattern = tuple(bool(p) for p in np.asarray(pattern).reshape(-1).tolist())
    if len(pattern) != num_layers:
        raise MalformedDFlash(source, f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
    return pattern


def _dflash2_fields(metadata, shapes, num_layers, hidden_size, source) -> dict:
    """{} for DFlash1; the conv/selector sizes for DFlash2; refuses partial presence by name."""
    wanted = [f"blk.{i}.{t}" for i in range(num_layers) for t in CONV_TENSORS] + list(SELECTOR_TENSORS)
    keys = [f"{ARCH}.{k}" for k in DFLASH2_KEYS]
    present = [n for n in wanted if n in shapes] + [k for k in keys if metadata.get(k)]
    if not present:
        return {}
    missing = [n for n in wanted if n not in shapes] + [k for k in keys if not metadata.get(k)]
    if missing:
        raise MalformedDFlash(source, f"DFlash2 file missing {', '.join(missing[:4])}"
                                      f"{' …' if len(missing) > 4 else ''} (it has {present[0]})")
    KS, gs, R, K = (int(metadata[k]) for k in keys)
    if hidden_size % gs:
        raise MalformedDFlash(source, f"hidden size {hidden_size} is not a multiple of conv_group_size {gs}")
    V = shapes["selector_predecessor.weight"][0]
    if not 1 <= K <= V:
        raise MalformedDFlash(source, f"selector_top_k {K} outside 1..{V}")
    if hidden_size < K * (K + 1):  # llama.cpp packs the K + K·K lattice scores into hidden-wide rows
        raise MalformedDFlash(source, f"selector_top_k {K} needs hidden size >= K(K+1) = {K * (K + 1)}, "
                                      f"the drafter's is {hidden_size} (llama.cpp refuses such a file too)")
    return dict(generation=2, conv_kernel_size=KS, conv_group_size=gs, selector_rank=R, selector_top_k=K,
                selector_vocab_size=V)


def _check_tensors(config: DFlashConfig, shapes, source):
    expected = config.expected_shapes()
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise MalformedDFlash(source, f"missing tensors {missing[:4]}")
    wrong = [f"{n} {tuple(shapes[n])} (expected {s})" for n, s in expected.items() if tuple(shapes[n]) != s]
    if wrong:
        raise MalformedDFlash(source, f"tensor shapes do not fit the keys: {'; '.join(wrong[:3])}")
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise UnsupportedDFlash(source, f"tensors the DFlash math does not read: {unknown[:6]}",
                                "the file is another variant (llama.cpp refuses it by tensor count too)")
