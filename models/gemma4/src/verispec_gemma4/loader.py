"""GGUF -> config -> module for gemma3 and gemma4 files: I/O only, no math beyond dequantise.

`load(path, dtype=..., context_length=...)` is the TargetSpec loader. Steps:
1. `GGUFFile.open` (verispec.gguf_io): metadata and the tensor table.
2. `Gemma3Config` / `Gemma4Config.from_gguf_metadata` and a model on the meta device.
3. Weights: one name table per family (GGUF name -> HF-style parameter name); each tensor dequantised
   to fp32 (gguf.quants), shape-checked, converted to the chosen weight dtype one at a time
   (nn.quant), then `load_state_dict(assign=True)`.
   Dequantising Q4_K/Q5_0 and requantising takes seconds, so the converted state goes
   through `verispec.weight_cache` and the next load memory-maps it (the 270M: ~0.3 s).
4. The tokenizer from the file's own metadata (verispec.tokenizer).
"""
from __future__ import annotations

import os

import attrs
import torch
from verispec.weight_cache import cached_state
from verispec.gguf_io import GGUFFile, MissingTensor
from verispec.nn.state import MAX_VERIFY_ROWS
from verispec.nn.quant import Float32Linear, canonical_dtype

from verispec_gemma4.modeling_gemma3 import Gemma3Config, Gemma3ForCausalLM
from verispec_gemma4.modeling_gemma4 import Gemma4Config, Gemma4ForCausalLM

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

#: gemma4 (llama.cpp src/models/gemma4 loader, gguf-py MODEL_TENSORS[GEMMA4]; reference/gemma4.md §2.3).
#: Norms are stored as w (no +1). KV-shared layers have no attn_k/attn_v/attn_k_norm; full layers
#: of K=V models no attn_v (the model then builds no v_proj, so neither is looked up).
#: Source syntax: "name[e]" = expert e's slice of a 3-D tensor [E, ...]; "a+b" = a and b stacked
#: along rows; "x or y" = y when x is absent; a trailing "?" = optional (the module's default, 1).
GEMMA4_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.layer_output_scale.weight?": "model.layers.{i}.layer_scalar",
    "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
    "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
    "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.router.proj.weight",
    "blk.{i}.ffn_gate_inp.scale": "model.layers.{i}.router.scale",
    "blk.{i}.ffn_down_exps.scale?": "model.layers.{i}.router.per_expert_scale",
    "blk.{i}.pre_ffw_norm_2.weight": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
    "blk.{i}.post_ffw_norm_1.weight": "model.layers.{i}.post_feedforward_layernorm_1.weight",
    "blk.{i}.post_ffw_norm_2.weight": "model.layers.{i}.post_feedforward_layernorm_2.weight",
    "blk.{i}.ffn_gate_up_exps.weight[e] or blk.{i}.ffn_gate_exps.weight[e]+blk.{i}.ffn_up_exps.weight[e]":
        "model.layers.{i}.experts.gate_up_proj.{e}.weight",
    "blk.{i}.ffn_down_exps.weight[e]": "model.layers.{i}.experts.down_proj.{e}.weight",
}



class UnsupportedArchitecture(ValueError):
    def __init__(self, path: str, architecture: str):
        self.path, self.architecture = path, architecture
        super().__init__(f"{path} is a {architecture!r} GGUF; verispec-gemma4 loads 'gemma3' and 'gemma4' files")


def load(path: str | os.PathLike, *, dtype: str | None = None, context_length: int | None = None,
         threads: int | None = None, max_rows_per_forward: int | None = None,
         max_verify_rows: int = MAX_VERIFY_ROWS, use_cache: bool = True, tokenizer: bool = True,
         progress: bool | None = None):
    """Load a gemma3 or gemma4 GGUF as a `Gemma3ForCausalLM` / `Gemma4ForCausalLM` trunk.

    dtype: "int8" (default) | "bfloat16"/"bf16" | "float32"/"fp32".
    context_length: max positions (default: the file's context_length).
    max_rows_per_forward, max_verify_rows: chunk length and ring slack (see Gemma3ForCausalLM).
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
    options = {"dtype": dtype, "context_length": context_length, "max_rows_per_forward": max_rows_per_forward,
                   "max_verify_rows": max_verify_rows}
    if arch == "gemma3":
        config = Gemma3Config.from_gguf_metadata(gguf.metadata, vocab_size=_rows(gguf, "token_embd.weight"),
                                                 tie_word_embeddings="output.weight" not in gguf)
        model, table = Gemma3ForCausalLM(config, **options), GEMMA3_TENSOR_NAMES
    elif arch == "gemma4":
        config = _gemma4_config(gguf)
        model, table = Gemma4ForCausalLM(config, **options), GEMMA4_TENSOR_NAMES
    else:
        raise UnsupportedArchitecture(path, arch)
    names = expand_names(table, config.num_hidden_layers, getattr(config, "num_experts", 0))
    state = cached_state(gguf, dtype, lambda: convert_state(gguf, model, names, progress), use_cache=use_cache,
                         layout="gemma")
    model.load_state_dict(state, assign=True)
    model.eval()
    if tokenizer:
        from verispec.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_gguf(gguf)
    return model


def _rows(gguf: GGUFFile, name: str) -> int:
    return gguf.tensor_info(name).shape[0]


def _gemma4_config(gguf: GGUFFile) -> Gemma4Config:
    """Metadata plus what only the tensor table says (vocab sizes, rope_freqs, K=V, tying)."""
    config = Gemma4Config.from_gguf_metadata(gguf.metadata, vocab_size=_rows(gguf, "token_embd.weight"))
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention" and i < config.first_kv_shared_layer]
    return attrs.evolve(
        config,
        full_rope_freq_factors=tuple(gguf.tensor("rope_freqs.weight").tolist()) if "rope_freqs.weight" in gguf else None,
        vocab_size_per_layer_input=_rows(gguf, "per_layer_token_embd.weight") if "per_layer_token_embd.weight" in gguf else 0,
        attention_k_eq_v=bool(full) and f"blk.{full[0]}.attn_v.weight" not in gguf,
        tie_word_embeddings="output.weight" not in gguf,
    )


def expand_names(table: dict[str, str], num_layers: int, num_experts: int = 0) -> dict[str, str]:
    """Our parameter name -> GGUF source, "{i}" expanded per layer and "{e}" per expert
    (source "name[e]" = expert e's slice of a 3-D tensor)."""
    out = {}
    for gguf_name, ours in table.items():
        for i in range(num_layers) if "{i}" in gguf_name else [None]:
            for e in range(num_experts) if "{e}" in ours else [None]:
                source = gguf_name.replace("{i}", str(i)).replace("[e]", f"[{e}]")
                out[ours.format(i=i, e=e)] = source
    return out


def convert_state(gguf: GGUFFile, model: torch.nn.Module, names: dict[str, str],
                  progress: bool | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict read from `gguf`: each linear converted to its module's weight
    dtype (nn.quant), every other tensor (norms, scalars) fp32 as stored.
    Raises MissingTensor, BadTensorShape."""
    from tqdm.auto import tqdm

    linears = {prefix: m for prefix, m in model.named_modules() if isinstance(m, Float32Linear)}
    defaults = model.state_dict()
    jobs = {f"{prefix}.weight": (m, (m.out_features, m.in_features)) for prefix, m in linears.items()}
    for name, value in defaults.items():
        if name.rsplit(".", 1)[0] not in linears:
            jobs[name] = (None, tuple(value.shape))
    reader = _TensorReader(gguf)
    state = {}
    for name, (module, shape) in tqdm(jobs.items(), desc="converting weights", unit="tensor",
                                      disable=None if progress is None else not progress, delay=1.0):
        source = names.get(name)
        if source is None:
            raise MissingTensor(f"<no GGUF name for {name}>", gguf.architecture, gguf.path)
        tensor = reader.read(source, shape)
        if tensor is None:  # optional and absent: keep the module's default
            state[name] = defaults[name].clone()
        elif module is not None:
            prefix = name.rsplit(".", 1)[0]
            for key, value in type(module).from_float(tensor).state_dict().items():
                state[f"{prefix}.{key}"] = value
        else:
            state[name] = tensor.float()
    return state


class _TensorReader:
    """Reads one table source (syntax above) as fp32 in torch order, shape-checked."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self._stacked: dict[str, torch.Tensor] = {}  # the last 3-D expert tensor, dequantised once

    def read(self, source: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        optional = source.endswith("?")
        alternatives = source.rstrip("?").split(" or ")
        for alternative in alternatives:
            parts = alternative.split("+")
            if all(self._base(p) in self.gguf for p in parts):
                if len(parts) == 1:
                    return self._part(parts[0], shape)
                rows = shape[0] // len(parts)
                return torch.cat([self._part(p, (rows, *shape[1:])) for p in parts])
        if optional:
            return None
        raise MissingTensor(self._base(alternatives[0].split("+")[0]), self.gguf.architecture, self.gguf.path)

    @staticmethod
    def _base(part: str) -> str:
        return part.split("[")[0]

    def _part(self, part: str, shape: tuple[int, ...]) -> torch.Tensor:
        if not part.endswith("]"):
            return self.gguf.tensor(self.gguf.expect_shape(part, shape).name)
        base, index = part[:-1].split("[")
        if base not in self._stacked:
            self.gguf.expect_shape(base, (self.gguf.tensor_info(base).shape[0], *shape))
            self._stacked = {base: self.gguf.tensor(base)}
        return self._stacked[base][int(index)]
