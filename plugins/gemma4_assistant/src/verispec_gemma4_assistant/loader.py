"""The `DraftFileSpec` loader: an assistant GGUF bound to its Gemma 4 trunk (docs/reference/gemma4.md §2.4).

GGUF tensor -> parameter (HF's names). `mtp_*` are llama.cpp's names, `nextn_*` its earlier
revisions'. The centroid head (`mtp_centroids`, `mtp_token_ordering`) is read when present;
`rope_freqs` goes into the config (absent: the trunk's full-layer RoPE, which rotated the K the
assistant reads). Weights take the trunk's weight dtype.
"""
from __future__ import annotations

import os

import attrs
import torch
from verispec.errors import DamagedFile, UnusedTensors
from verispec.gguf.checks import check_drafter_values, check_numbers
from verispec.gguf.io import GGUFFile
from verispec.gguf.load import plan_weights
from verispec.gguf.table import Stack, Tensor
from verispec.seams import DrafterMismatch
from verispec.weights.quant import swap_linears

from verispec_gemma4_assistant.binding import binding_problem
from verispec_gemma4_assistant.config import CENTROIDS, TOKEN_ORDERING, AssistantConfig
from verispec_gemma4_assistant.head import Gemma4AssistantHead
from verispec_gemma4_assistant.modeling import Gemma4Assistant

__all__ = ["TENSORS", "load"]

ROPE_FREQS = "rope_freqs.weight"
TENSORS = (
    Tensor("token_embd.weight", "model.embed_tokens.weight"),
    Tensor("output_norm.weight", "model.norm.weight"),
    Tensor("mtp_pre_proj.weight", "pre_projection.weight", alternatives=("nextn_pre_proj.weight",)),
    Tensor("mtp_post_proj.weight", "post_projection.weight", alternatives=("nextn_post_proj.weight",)),
    Tensor(CENTROIDS, "masked_embedding.centroids.weight"),
    Tensor("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Tensor("blk.{i}.attn_q.weight", "model.layers.{i}.q_proj.weight"),
    Tensor("blk.{i}.attn_q_norm.weight", "model.layers.{i}.q_norm.weight"),
    Tensor("blk.{i}.attn_output.weight", "model.layers.{i}.o_proj.weight"),
    Tensor("blk.{i}.post_attention_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Tensor("blk.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    Tensor(Stack("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"), "model.layers.{i}.mlp.gate_up_proj.weight"),
    Tensor("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    Tensor("blk.{i}.post_ffw_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    Tensor("blk.{i}.layer_output_scale.weight", "model.layers.{i}.layer_scalar", optional=True),
)


def load(path: str | os.PathLike, trunk, *, centroids: bool = False, use_cache: bool = True) -> Gemma4AssistantHead:
    """The assistant in `path` as the draft head of `trunk` (a Gemma 4 trunk).

    centroids: draft with the centroid head (the file must have one) instead of the dense head.
    Raises seams.DrafterMismatch (a VerispecError) when the assistant was made for other sizes
    (binding.binding_problem names the difference), errors.UnsupportedArchitecture, verispec.gguf.errors
    errors (MissingKey, MissingTensor, BadTensorShape), errors.DamagedFile (bad numbers, a token
    ordering that is not a permutation of the vocabulary, a tensor holding a NaN or an infinity: the
    file and the tensor are named), errors.UnusedTensors (tensors the
    assistant's math does not read: a K/V projection, say), ValueError (centroids=True without them).
    """
    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    check_numbers(gguf)  # first: the config builds per-layer lists block_count long
    config = AssistantConfig.from_gguf(gguf.metadata, {n: gguf.tensor_info(n).shape for n in gguf}, source=path)
    problem = binding_problem(config, trunk)
    if problem is not None:
        raise DrafterMismatch(f"--draft-model {path}: {problem}")
    if centroids and not config.num_centroids:
        raise ValueError(f"{path} has no centroid head ({CENTROIDS}); draft with the dense head")
    factors = trunk.config.full_rope_freq_factors
    if ROPE_FREQS in gguf:
        gguf.expect_shape(ROPE_FREQS, (config.global_head_dim // 2,))
        values = gguf.tensor(ROPE_FREQS)
        check_drafter_values(path, ROPE_FREQS, values)
        factors = tuple(values.tolist())
    config = attrs.evolve(config, full_rope_freq_factors=factors)
    model = Gemma4Assistant(config, device="meta")
    swap_linears(model, trunk.dtype)
    plan = plan_weights(gguf, model, TENSORS, num_layers=config.num_hidden_layers)
    unused = plan.unused_tensors(read_elsewhere={ROPE_FREQS, TOKEN_ORDERING})
    if unused:
        raise UnusedTensors(path, "Gemma 4 assistant", unused)
    plan.load(dtype=trunk.dtype, layout="gemma4-assistant", use_cache=use_cache, progress=False, finite=True)
    if config.num_centroids:
        model.token_ordering = _token_ordering(gguf, config, path)
    return Gemma4AssistantHead(model, trunk, centroids=centroids, path=path)


def _token_ordering(gguf: GGUFFile, config: AssistantConfig, path: str) -> torch.Tensor:
    """int64 [V]: centroid c's tokens are entries [c·V/C, (c+1)·V/C). Raises MissingTensor, DamagedFile."""
    gguf.expect_shape(TOKEN_ORDERING, (config.vocab_size,))
    ordering = gguf.tensor(TOKEN_ORDERING).reshape(-1).long()
    if not torch.equal(torch.sort(ordering).values, torch.arange(config.vocab_size)):
        raise DamagedFile(path, f"{TOKEN_ORDERING} is not a permutation of the {config.vocab_size} token ids")
    return ordering
