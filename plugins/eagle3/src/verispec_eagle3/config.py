"""The GGUF contract of an EAGLE-3 head: `Eagle3Config.from_gguf(metadata, shapes, source)`.

Keys sit under `eagle3.` (llama.cpp `LLM_ARCH_EAGLE3`; the `%s.target_layers`,
`%s.target_hidden_size`, `%s.norm_before_residual` names are the ones llama.cpp shares with DFlash):

- `target_layers`: 3 trunk layer ids (the converter's default [2, L//2, L-3]); `extract_layers`, the
  spelling of older llama.cpp builds, is read when `target_layers` is absent.
- `target_hidden_size`: Dt, the width of one tapped trunk row (fc reads 3·Dt).
- `norm_before_residual` (default false), `norm_before_fc` (default false; see `loader`).
- the llama block keys: `block_count` (must be 1), `embedding_length` D, `feed_forward_length` I,
  `attention.head_count` H, `attention.head_count_kv` Hkv, `attention.key_length` Dh (default D/H),
  `attention.layer_norm_rms_epsilon`, `rope.freq_base` (default 10000), `rope.dimension_count`
  (must be Dh), `rope.scaling.type` none/linear.

Tensors (torch-order shapes; V the trunk's vocabulary, Vd the draft vocabulary):
`fc.weight` [D, 3·Dt]; `blk.0.attn_norm` [D] (token embedding norm), `blk.0.attn_norm_2` [D] (the
hidden norm), `blk.0.attn_q` [H·Dh, 2D], `attn_k`/`attn_v` [Hkv·Dh, 2D], `attn_output` [D, H·Dh],
`ffn_norm` [D], `ffn_gate`/`ffn_up` [I, D], `ffn_down` [D, I], `output_norm` [D]; optional:
`output.weight` [Vd, D] (absent: the trunk's LM head, Vd = V), `token_embd.weight` [V, D] (absent:
the trunk's embedding), `d2t` I64 [Vd] (absolute target ids; absent: Vd = V, identity),
`rope_freqs.weight` [Dh/2] (llama3-style frequency divisors), `enc.output_norm.weight` [3·Dt]
(only with norm_before_fc).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
from verispec.errors import UnsupportedArchitecture, UnsupportedVariant, UnusedTensors
from verispec.gguf.io import MissingTensor, arch_value

from verispec_eagle3.hooks import ARCHITECTURES

ARCH = ARCHITECTURES[0]
FC, D2T, OUTPUT, TOKEN_EMBD, ROPE_FREQS, FC_NORM = (
    "fc.weight", "d2t", "output.weight", "token_embd.weight", "rope_freqs.weight", "enc.output_norm.weight")
#: the block's tensors, after "blk.0."
LAYER_TENSORS = ("attn_norm.weight", "attn_norm_2.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                 "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
FIX = "convert the head again with llama.cpp's convert_hf_to_gguf.py (--target-model-dir the target)"


class UnsupportedEagle3(UnsupportedVariant):
    """An `eagle3` GGUF using something this package does not run (several layers, partial RoPE,
    a RoPE scaling other than linear / rope_freqs, biases): refused by name rather than run wrongly."""


@attrs.frozen
class Eagle3Config:
    """Sizes and switches of one head (the module docstring's letters)."""

    hidden_size: int  # D
    intermediate_size: int  # I
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # Dh
    rms_eps: float
    rope_theta: float
    #: positions divided by this (rope.scaling.type linear); 1.0 = none.
    rope_linear_factor: float
    #: trunk layer ids whose entering residuals are fused (Segment.tap_layers numbering).
    target_layers: tuple[int, ...]
    target_hidden_size: int  # Dt
    norm_before_residual: bool
    norm_before_fc: bool
    #: Vd: the rows of the head's logits before d2t maps them (None: the trunk's vocabulary).
    draft_vocab_size: int | None
    own_output: bool
    own_embedding: bool
    #: rows of the head's own token_embd (None without one).
    embedding_rows: int | None = None

    @classmethod
    def from_gguf(cls, metadata: Mapping, shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> Eagle3Config:
        """shapes: GGUF tensor name -> torch-order shape. Raises errors.UnsupportedArchitecture,
        gguf MissingKey / MissingTensor / BadTensorShape (via `check_shapes`), UnsupportedEagle3,
        errors.UnusedTensors (tensors the math does not read)."""
        arch = metadata.get("general.architecture")
        if arch != ARCH:
            raise UnsupportedArchitecture(source, arch, ARCHITECTURES)
        key = functools.partial(arch_value, metadata, source=source)
        blocks = int(key("block_count"))
        if blocks != 1:
            raise UnsupportedEagle3(source, f"eagle3.block_count is {blocks}", "EAGLE-3 heads have one decoder "
                                    "layer (llama.cpp asserts n_layer == 1)")
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedEagle3(source, "attention key and value head sizes differ", "llama.cpp asserts them equal")
        if int(key("rope.dimension_count", head_dim)) != head_dim:
            raise UnsupportedEagle3(source, f"rope.dimension_count {key('rope.dimension_count')} < head dim "
                                    f"{head_dim} (partial RoPE)", "only full-width RoPE is implemented")
        layers = key("target_layers", None)
        if layers is None:
            layers = key("extract_layers")
        layers = tuple(int(x) for x in layers)
        if len(layers) != 3:
            raise UnsupportedEagle3(source, f"eagle3.target_layers has {len(layers)} ids {list(layers)}",
                                    f"EAGLE-3 fuses 3 trunk layers (llama.cpp b11434 requires 3); {FIX}")
        if FC not in shapes:
            raise MissingTensor(FC, arch, source)
        target_hidden = int(key("target_hidden_size", shapes[FC][-1] // 3))
        vd = shapes[OUTPUT][0] if OUTPUT in shapes else (shapes[D2T][0] if D2T in shapes else None)
        config = cls(
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_linear_factor=_rope_linear_factor(key, source),
            target_layers=layers,
            target_hidden_size=target_hidden,
            norm_before_residual=bool(key("norm_before_residual", False)),
            norm_before_fc=bool(key("norm_before_fc", False)),
            draft_vocab_size=None if vd is None else int(vd),
            own_output=OUTPUT in shapes,
            own_embedding=TOKEN_EMBD in shapes,
            embedding_rows=int(shapes[TOKEN_EMBD][0]) if TOKEN_EMBD in shapes else None,
        )
        config.check_shapes(shapes, source)
        return config

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> torch-order shape of every tensor this head reads (the optional ones it has)."""
        d, dt, i = self.hidden_size, self.target_hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = {FC: (d, 3 * dt), "output_norm.weight": (d,)}
        layer = {"attn_norm.weight": (d,), "attn_norm_2.weight": (d,), "attn_q.weight": (q, 2 * d),
                 "attn_k.weight": (kv, 2 * d), "attn_v.weight": (kv, 2 * d), "attn_output.weight": (d, q),
                 "ffn_norm.weight": (d,), "ffn_gate.weight": (i, d), "ffn_up.weight": (i, d), "ffn_down.weight": (d, i)}
        out.update({f"blk.0.{name}": shape for name, shape in layer.items()})
        if self.norm_before_fc:
            out[FC_NORM] = (3 * dt,)
        if self.own_output:
            out[OUTPUT] = (self.draft_vocab_size, d)
        if self.own_embedding:
            out[TOKEN_EMBD] = (self.embedding_rows, d)
        return out

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
        """Every tensor the math reads present with its shape, d2t one id per draft row, nothing
        else but rope_freqs. Raises MissingTensor, UnsupportedEagle3 (a shape off), UnusedTensors."""
        expected = self.expected_shapes()
        for name, shape in expected.items():
            if name not in shapes:
                raise MissingTensor(name, ARCH, source)
            if tuple(shapes[name]) != tuple(shape):
                raise UnsupportedEagle3(source, f"{name} is {list(shapes[name])}, the keys say {list(shape)}", FIX)
        if D2T in shapes and (len(shapes[D2T]) != 1 or shapes[D2T][0] != self.draft_vocab_size):
            raise UnsupportedEagle3(source, f"d2t is {list(shapes[D2T])}, the head scores {self.draft_vocab_size} "
                                    "draft rows (output.weight)", FIX)
        if ROPE_FREQS in shapes and tuple(shapes[ROPE_FREQS]) != (self.head_dim // 2,):
            raise UnsupportedEagle3(source, f"{ROPE_FREQS} is {list(shapes[ROPE_FREQS])}, not [{self.head_dim // 2}]",
                                    FIX)
        unused = sorted(set(shapes) - set(expected) - {D2T, ROPE_FREQS})
        if unused:
            raise UnusedTensors(source, "EAGLE-3", unused)


def _rope_linear_factor(key, source: str) -> float:
    kind = key("rope.scaling.type", "none")
    if kind in ("none", ""):
        return 1.0
    if kind == "linear":
        return float(key("rope.scaling.factor", 1.0))
    raise UnsupportedEagle3(source, f"rope scaling type {kind!r}", "supported: none, linear, and rope_freqs factors")
