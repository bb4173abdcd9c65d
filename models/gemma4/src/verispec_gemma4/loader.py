"""GGUF -> config -> module for gemma3 (and gemma4) files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TargetSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf_io): metadata and the tensor table.
2. `Gemma3Config.from_gguf_metadata` and a model on the meta device.
3. Weights: one name table (GGUF name -> HF-style parameter name); each tensor dequantised
   to fp32 (gguf.quants), shape-checked, converted to the chosen weight dtype one at a time
   (nn.quant), then `load_state_dict(assign=True)`.
   Dequantising Q4_K/Q5_0 and requantising takes seconds, so the converted state is saved
   under `cache_dir("weights")`, keyed by the file's path, size and mtime and the dtype,
   and the next load reads it back (the 270M: ~0.3 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

from verispec.gguf_io import BadTensorShape, GGUFFile, MissingTensor
from verispec.nn.norm import RMSNorm
from verispec.nn.quant import Float32Linear, canonical_dtype

from verispec_gemma4.modeling_gemma3 import Gemma3Config, Gemma3ForCausalLM

#: weight dtype when the caller does not choose one. int8 weight-only: batch-invariant (a
#: verify row is bitwise the one-row decode), the fastest decode and the cheapest k-row verify
#: on CPU (measurements in the package README).
DEFAULT_DTYPE = "int8"

#: GGUF tensor name -> parameter name in our modules (HF's names); "{i}" = layer index.
#: gguf-py MODEL_TENSORS[GEMMA3]; reference/gemma4.md §2.1 gives the HF <-> GGUF pairs.
GEMMA3_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",  # only in files with an untied LM head
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}

_CACHE_FORMAT = 1  # bump when the converted layout changes: old cache files are then ignored
_CACHE_MIN_SECONDS = 1.0  # conversions faster than this are not worth a cache file


class UnsupportedArchitecture(ValueError):
    def __init__(self, path: str, architecture: str):
        self.path, self.architecture = path, architecture
        super().__init__(f"{path} is a {architecture!r} GGUF; verispec-gemma4 loads 'gemma3' and 'gemma4' files")


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         threads: int | None = None, max_rows_per_forward: int = 16, use_cache: bool = True,
         tokenizer: bool = True, progress: bool | None = None):
    """Load a gemma3 GGUF as a `Gemma3ForCausalLM` trunk.

    dtype: "int8" (default) | "bfloat16"/"bf16" | "float32"/"fp32".
    context_length: max positions (default: the file's context_length).
    use_cache: read/write converted weights under verispec's cache dir.
    progress: tqdm bar while converting (None: on a terminal, after a second).
    Raises gguf_io errors (MissingTensor, BadTensorShape, ...), UnsupportedArchitecture,
    nn.quant.UnknownWeightDtype.
    """
    path = os.fspath(path)
    dtype = canonical_dtype(dtype or DEFAULT_DTYPE)
    if threads:
        torch.set_num_threads(threads)
    gguf = GGUFFile.open(path)
    arch = gguf.architecture
    if arch != "gemma3":
        raise UnsupportedArchitecture(path, arch)
    vocab_size = gguf.tensor_info("token_embd.weight").shape[0]
    config = Gemma3Config.from_gguf_metadata(gguf.metadata, vocab_size=vocab_size,
                                             tie_word_embeddings="output.weight" not in gguf)
    model = Gemma3ForCausalLM(config, dtype=dtype, context_length=context_length,
                              max_rows_per_forward=max_rows_per_forward)
    names = expand_names(GEMMA3_TENSOR_NAMES, config.num_hidden_layers)
    model.load_state_dict(_converted_state(gguf, model, names, dtype, use_cache, progress), assign=True)
    model.eval()
    if tokenizer:
        from verispec.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_gguf(gguf)
    return model


def expand_names(table: dict[str, str], num_layers: int) -> dict[str, str]:
    """Our parameter name -> GGUF tensor name, with "{i}" expanded for every layer."""
    out = {}
    for gguf_name, ours in table.items():
        if "{i}" in gguf_name:
            for i in range(num_layers):
                out[ours.format(i=i)] = gguf_name.format(i=i)
        else:
            out[ours] = gguf_name
    return out


def convert_state(gguf: GGUFFile, model: torch.nn.Module, names: dict[str, str],
                  progress: bool | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict read from `gguf`: each linear converted to its module's weight
    dtype, each norm weight fp32 as stored. Raises MissingTensor, BadTensorShape."""
    from tqdm.auto import tqdm

    expected = {}  # parameter name -> (module, torch-order shape)
    for prefix, module in model.named_modules():
        if isinstance(module, (Float32Linear, RMSNorm)) and getattr(module, "weight", None) is not None:
            shape = (module.out_features, module.in_features) if isinstance(module, Float32Linear) else (module.dim,)
            expected[f"{prefix}.weight"] = (module, shape)
    state = {}
    arch = gguf.architecture
    for name, (module, shape) in tqdm(expected.items(), desc="converting weights", unit="tensor",
                                      disable=None if progress is None else not progress, delay=1.0):
        if name not in names:
            raise MissingTensor(f"<no GGUF name for {name}>", arch, gguf.path)
        info = gguf.expect_shape(names[name], shape)
        tensor = gguf.tensor(info.name)
        if isinstance(module, Float32Linear):
            prefix = name.rsplit(".", 1)[0]
            for key, value in type(module).from_float(tensor).state_dict().items():
                state[f"{prefix}.{key}"] = value
        else:
            state[name] = tensor.float()
    return state


def _converted_state(gguf: GGUFFile, model, names, dtype: str, use_cache: bool, progress):
    cache_file = _cache_file(gguf.path, dtype) if use_cache else None
    if cache_file is not None and cache_file.is_file():
        try:
            return torch.load(cache_file, weights_only=True)
        except Exception:  # a damaged or foreign cache file is just a cache miss
            cache_file.unlink(missing_ok=True)
    started = time.perf_counter()
    state = convert_state(gguf, model, names, progress)
    if cache_file is not None and time.perf_counter() - started > _CACHE_MIN_SECONDS:
        partial = cache_file.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, cache_file)
    return state


def _cache_file(path: str, dtype: str) -> Path | None:
    from verispec.checkpoints import cache_dir

    stat = os.stat(path)
    key = f"{_CACHE_FORMAT}|{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir("weights") / f"{Path(path).stem}-{dtype}-{digest}.pt"
