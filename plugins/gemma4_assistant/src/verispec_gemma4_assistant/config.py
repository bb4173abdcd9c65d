"""The assistant GGUF's numbers: `AssistantConfig.from_gguf` (docs/reference/gemma4.md §2.4).

Keys sit under the file's own architecture prefix: `gemma4-assistant.` (llama.cpp), or a fork's
`gemma4_assistant.` / `gemma4_mtp.`. Besides the gemma4 keys a block of its own uses, the file
says `embedding_length_out`: the hidden size D of the trunk it drafts for (its rows come in,
its next-step rows go out at that width). The vocabulary is the rows of `token_embd` (the
assistant's own table, its tied LM head); the centroid head, when the file has
`mtp_centroids`, has as many centroids as that tensor's rows.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
from verispec.errors import DamagedFile, UnsupportedArchitecture
from verispec.gguf.io import MissingTensor, arch_value
from verispec_gemma4.modeling_gemma4 import FULL, SLIDING, _layer_types, _per_layer, _sliding_window

from verispec_gemma4_assistant.hooks import ARCHITECTURES

__all__ = ["ARCHITECTURES", "AssistantConfig", "CENTROIDS", "FULL", "SLIDING", "TOKEN_ORDERING"]

CENTROIDS, TOKEN_ORDERING = "mtp_centroids.weight", "mtp_token_ordering.weight"
#: centroids whose tokens the centroid head scores (transformers' centroid_intermediate_top_k;
#: 32 in every shipped assistant); a file may say otherwise under `{arch}.centroid_top_k`.
DEFAULT_CENTROID_TOP_K = 32


@attrs.frozen
class AssistantConfig:
    vocab_size: int  # V
    hidden_size: int  # the assistant's own width
    backbone_hidden_size: int  # D, the trunk's hidden size (embedding_length_out)
    num_hidden_layers: int
    num_attention_heads: int  # H, both layer types
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    num_key_value_heads: tuple[int, ...] = attrs.field(converter=tuple)  # per layer: the trunk's, for grouping
    intermediate_size: tuple[int, ...] = attrs.field(converter=tuple)
    head_dim: int = 256  # sliding layers
    global_head_dim: int = 512  # full layers
    sliding_window: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    #: full layers' per-pair RoPE divisors (rope_freqs); None = the trunk's.
    full_rope_freq_factors: tuple[float, ...] | None = None
    num_centroids: int = 0  # 0 = no centroid head in the file
    centroid_top_k: int = DEFAULT_CENTROID_TOP_K

    def layer_head_dim(self, layer_idx: int) -> int:
        return self.head_dim if self.layer_types[layer_idx] == SLIDING else self.global_head_dim

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> AssistantConfig:
        """tensor_shapes: GGUF tensor name -> torch-order shape. The layer pattern defaults to
        sliding layers closed by one full layer (every shipped assistant).
        Raises errors.UnsupportedArchitecture, gguf.errors.MissingKey (embedding_length_out among
        them), gguf.errors.MissingTensor (token_embd), errors.DamagedFile (per-layer lists not one per
        layer, a vocabulary the centroids do not divide, a centroid top-k outside 1..centroids)."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(source, arch, ARCHITECTURES)
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)
        num_layers = int(key("block_count"))
        pattern = key("attention.sliding_window_pattern", None)
        layer_types = (_layer_types(pattern, num_layers, source) if pattern is not None
                       else [SLIDING] * (num_layers - 1) + [FULL])
        global_head_dim = int(key("attention.key_length"))
        vocab_size = int(tensor_shapes["token_embd.weight"][0])
        num_centroids = int(tensor_shapes[CENTROIDS][0]) if CENTROIDS in tensor_shapes else 0
        top_k = int(key("centroid_top_k", DEFAULT_CENTROID_TOP_K))
        if num_centroids and (vocab_size % num_centroids or not 0 < min(top_k, num_centroids) == top_k):
            raise DamagedFile(source, f"{num_centroids} centroids with top-k {top_k} over a {vocab_size}-token "
                              "vocabulary: the centroids must divide the vocabulary and top-k lie in 1..centroids")
        return cls(
            vocab_size=vocab_size,
            hidden_size=int(key("embedding_length")),
            backbone_hidden_size=int(key("embedding_length_out")),
            num_hidden_layers=num_layers,
            num_attention_heads=int(key("attention.head_count")),
            layer_types=layer_types,
            num_key_value_heads=_per_layer(key("attention.head_count_kv"), num_layers, "attention.head_count_kv",
                                           source),
            intermediate_size=_per_layer(key("feed_forward_length"), num_layers, "feed_forward_length", source),
            head_dim=int(key("attention.key_length_swa", global_head_dim)),
            global_head_dim=global_head_dim,
            sliding_window=_sliding_window(key("attention.sliding_window", 512), source),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
            num_centroids=num_centroids,
            centroid_top_k=top_k if num_centroids else DEFAULT_CENTROID_TOP_K,
        )

