"""What a GGUF's numbers must satisfy before a trunk is built from it: `check_numbers` (sizes the
tensors back, positive counts, finite floats, bos/eos inside the vocabulary; metadata and the
tensor table only) and `check_finite` (every tensor's values; run only when logits come out
non-finite). Both raise errors.DamagedFile naming the key or tensor and the numbers.

A drafter's loader checks its values at load instead (`check_drafter_values`, on the float
tensors it reads anyway): a NaN in a draft head never shows in the output, which the trunk
verifies, only in drafts that are never accepted.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verispec.gguf.io import GGUFFile

__all__ = ["DRAFTER_FIX", "FLOATS", "POSITIVE_SIZES", "SIZES", "check_drafter_values", "check_finite",
           "check_numbers"]


#: `{arch}.*` sizes that count heads or elements of a tensor: none can exceed the largest tensor
#: dimension in the file (a head count <= the q rows, a rope width <= the head width, ...).
SIZES = ("attention.head_count", "attention.head_count_kv", "embedding_length", "feed_forward_length",
         "attention.key_length", "attention.value_length", "attention.key_length_swa",
         "attention.value_length_swa", "rope.dimension_count", "rope.dimension_count_swa",
         "ssm.inner_size", "ssm.state_size", "ssm.conv_kernel", "ssm.time_step_rank", "ssm.group_count",
         "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
         "embedding_length_per_layer_input",
         # MLA, its sparse indexer, grouped experts, KDA, hyper-connections (glm4moe, glm-dsa, glm5-next)
         "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
         "attention.indexer.head_count", "attention.indexer.key_length", "expert_group_count",
         "expert_group_used_count", "expert_shared_count", "kda.head_dim", "hyper_connection.count")
#: sizes a model divides by or builds from: zero (in every layer) is damage.
POSITIVE_SIZES = ("attention.head_count", "embedding_length", "attention.key_length", "attention.value_length",
                  "attention.key_length_swa", "attention.value_length_swa", "ssm.inner_size", "ssm.state_size",
                  "ssm.conv_kernel", "ssm.time_step_rank", "ssm.group_count", "attention.kv_lora_rank",
                  "attention.key_length_mla", "attention.value_length_mla", "attention.indexer.head_count",
                  "attention.indexer.key_length", "kda.head_dim", "hyper_connection.count")
#: counts that size a loop rather than a tensor, with their bounds (inclusive): a forward runs
#: sinkhorn_iterations normalisation passes per layer and token, so 10^9 of them is a hang.
LOOP_COUNTS = {"attention.indexer.top_k": (1, 2**31 - 1), "hyper_connection.sinkhorn_iterations": (1, 1000)}
#: float keys and the smallest value each may hold (exclusive for RoPE bases and scales).
FLOATS = {"rope.freq_base": 0.0, "rope.freq_base_swa": 0.0, "rope.scaling.factor": 0.0,
          "attention.layer_norm_rms_epsilon": None, "attention.layer_norm_epsilon": None,
          "final_logit_softcapping": None, "attn_logit_softcapping": None, "expert_weights_scale": None,
          "hyper_connection.epsilon": None, "kda.gate_lower_bound": float("-inf")}
#: per-layer float lists (or one float for every layer): a finite, non-negative value for each block.
LAYER_FLOATS = ("swiglu_clamp_exp", "swiglu_clamp_shexp")


def check_numbers(gguf: GGUFFile) -> None:
    """Refuse a file whose sizes the tensors it holds do not back, before anything is built:
    `block_count` must be the number of `blk.N` indices present (0..N-1); every size in `SIZES`
    a non-negative integer no larger than the largest tensor dimension (so nothing sized by it
    outgrows the file), those in `POSITIVE_SIZES` positive in some layer; heads no more than
    `embedding_length` where the head width is derived from it; `embedding_length` token_embd's
    columns; a sliding window no wider than the context; the float keys of `FLOATS` finite
    (RoPE bases and scales positive, epsilons and softcaps non-negative) and `LAYER_FLOATS` one
    finite value per block; expert counts that agree, `LOOP_COUNTS` within bounds; the token list as long
    as token_embd's rows (llama.cpp's rule), the bos/eos ids inside it. Reads metadata and the
    tensor table only.
    Raises errors.DamagedFile (one line naming the key and the numbers), gguf.errors.MissingKey."""
    from verispec.errors import DamagedFile

    arch, source = gguf.architecture, gguf.path
    blocks = {int(n.split(".")[1]) for n in gguf if n.startswith("blk.") and n.split(".")[1].isdigit()}
    count = gguf.arch_key("block_count")
    if not _is_int(count) or count < 1 or count > len(blocks) or any(i not in blocks for i in range(count)):
        raise DamagedFile(source, f"{arch}.block_count is {count!r}, but the file has tensors for blocks "
                          f"{_span(blocks)}")
    _check_sizes(gguf)
    _check_experts(gguf)
    _check_floats(gguf, count)
    window, context = gguf.arch_key("attention.sliding_window", None), gguf.arch_key("context_length", None)
    if window is not None and not (_is_int(window) and window >= 0):
        raise DamagedFile(source, f"{arch}.attention.sliding_window is {window!r}: a window is a non-negative "
                          "integer (0: none)")
    if _is_int(window) and _is_int(context) and window > context:
        raise DamagedFile(source, f"{arch}.attention.sliding_window is {window}, wider than the "
                          f"{context}-token context_length")
    if "token_embd.weight" not in gguf:
        return
    rows, hidden = gguf.tensor_info("token_embd.weight").shape[:2]
    width = gguf.arch_key("embedding_length", None)
    if width is not None and width != hidden:
        raise DamagedFile(source, f"{arch}.embedding_length is {width}, but token_embd.weight is "
                          f"[{rows}, {hidden}]")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != rows:
        raise DamagedFile(source, f"the token list has {len(tokens)} entries, but token_embd.weight has "
                          f"{rows} rows")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        value = gguf.get(key)
        if value is not None and not (_is_int(value) and 0 <= value < rows):
            raise DamagedFile(source, f"{key} is {value!r}, outside the vocabulary of {rows} tokens")


def check_finite(gguf: GGUFFile) -> None:
    """Refuse a file with a tensor holding a NaN or an infinity once dequantised (the first in
    file order is named). Dequantises every tensor, one at a time: seconds (Gemma 3 270M's 253 MB
    of Q4_K/Q8_0: 9 s on a shared 2-core host, measured 2026-12-03), so it runs only after a
    forward produced unusable logits, never at load (checking the F32 tensors alone would take
    2 ms there, but would miss the quantised ones, which are most of every file).
    Raises errors.DamagedFile."""
    from verispec.errors import DamagedFile

    for name in gguf:
        values = gguf.tensor(name)
        if values.is_floating_point() and not torch.isfinite(values).all():
            bad = int((~torch.isfinite(values)).sum())
            raise DamagedFile(gguf.path, f"tensor {name!r} holds {bad} NaN or infinite values of {values.numel()}")


#: the fix a drafter file with non-finite values is refused with.
DRAFTER_FIX = ("convert the drafter again from its checkpoint, or train it again if the checkpoint "
               "itself holds them")


def check_drafter_values(source: str, name: str, values: torch.Tensor, *, of: str = "values") -> None:
    """Refuse a drafter (draft head) file whose tensor `name` holds a NaN or an infinity.

    source: the file (named first in the message). values: any dtype, any shape, as the loader
    read it (fp32 after gguf-py's dequantisation, or a quantised linear's fp16/fp32 block scales,
    `of="block scales"`); integer tensors cannot hold either and pass. One isfinite pass, at load.
    Raises errors.DamagedFile: `<source>: tensor 'blk.0.attn_q.weight' holds 3 NaN, 1 inf of
    1,048,576 values; <DRAFTER_FIX>`."""
    if not values.is_floating_point():
        return
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return
    from verispec.errors import DamagedFile

    nan = int(torch.isnan(values).sum())
    inf = int((~finite).sum()) - nan
    counts = ", ".join(part for part, n in ((f"{nan:,} NaN", nan), (f"{inf:,} inf", inf)) if n)
    raise DamagedFile(source, f"tensor {name!r} holds {counts} of {values.numel():,} {of}", fix=DRAFTER_FIX)


def _check_sizes(gguf: GGUFFile) -> None:
    """The `SIZES` / `POSITIVE_SIZES` rules of `check_numbers`."""
    from verispec.errors import DamagedFile

    arch, source = gguf.architecture, gguf.path
    largest = max((max(gguf.tensor_info(name).shape, default=0) for name in gguf), default=0)
    for key in SIZES:
        values = gguf.arch_key(key, None)
        if values is None:
            continue
        values = list(values) if isinstance(values, (list, tuple, np.ndarray)) else [values]
        if not all(_is_int(v) and v >= 0 for v in values):
            raise DamagedFile(source, f"{arch}.{key} holds {_short(values)}: counts are non-negative integers")
        if key in POSITIVE_SIZES and not any(v > 0 for v in values):
            raise DamagedFile(source, f"{arch}.{key} is {_short(values)}: a positive count is needed")
        if max(values, default=0) > largest:
            raise DamagedFile(source, f"{arch}.{key} is {_short(values)}, larger than any tensor dimension in "
                              f"the file ({largest})")
    heads, width = gguf.arch_key("attention.head_count", None), gguf.arch_key("embedding_length", None)
    heads = max(heads) if isinstance(heads, (list, tuple, np.ndarray)) else heads
    if gguf.arch_key("attention.key_length", None) is None and heads and width and heads > width:
        raise DamagedFile(source, f"{arch}.attention.head_count is {heads}, more heads than the {width} "
                          "embedding_length has dimensions (no attention.key_length says their width)")


def _check_floats(gguf: GGUFFile, num_blocks: int) -> None:
    """The `FLOATS` and `LAYER_FLOATS` rules of `check_numbers` (a floor of -inf: any finite value)."""
    from verispec.errors import DamagedFile

    for key, floor in FLOATS.items():
        value = gguf.arch_key(key, None)
        if value is None:
            continue
        number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
        if not number or not np.isfinite(value) or (value <= floor if floor is not None else value < 0):
            need = ("a finite value" if floor == float("-inf") else "a finite value above 0" if floor is not None
                    else "a finite value of 0 or more")
            raise DamagedFile(gguf.path, f"{gguf.architecture}.{key} is {value!r}: {need} is needed")
    for key in LAYER_FLOATS:
        value = gguf.arch_key(key, None)
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
        if isinstance(value, (list, tuple, np.ndarray)) and len(values) < num_blocks:
            raise DamagedFile(gguf.path, f"{gguf.architecture}.{key} has {len(values)} entries for {num_blocks} "
                              "blocks: one per block is needed")
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                   and np.isfinite(v) and v >= 0 for v in values):
            raise DamagedFile(gguf.path, f"{gguf.architecture}.{key} holds {_short(values)}: finite values of 0 "
                              "or more are needed")


def _check_experts(gguf: GGUFFile) -> None:
    """Expert counts that agree (used <= routed, groups that divide the experts, used groups <=
    groups) and the `LOOP_COUNTS` bounds."""
    from verispec.errors import DamagedFile

    arch, source = gguf.architecture, gguf.path

    def count(key):
        value = gguf.arch_key(key, None)
        return value if _is_int(value) else None
    experts, used = count("expert_count"), count("expert_used_count")
    if used is not None and experts is not None and (used > experts or (experts > 0 and used < 1)):
        raise DamagedFile(source, f"{arch}.expert_used_count is {used} of {arch}.expert_count {experts}: "
                          "between 1 and the expert count is needed")
    groups, used_groups = count("expert_group_count"), count("expert_group_used_count")
    if groups and experts and experts % groups:
        raise DamagedFile(source, f"{arch}.expert_group_count is {groups}, which does not divide the "
                          f"{experts} experts")
    if used_groups is not None and groups is not None and used_groups > max(groups, 1):
        raise DamagedFile(source, f"{arch}.expert_group_used_count is {used_groups}, more than the "
                          f"{groups} expert groups")
    for key, (low, high) in LOOP_COUNTS.items():
        value = gguf.arch_key(key, None)
        if value is not None and not (_is_int(value) and low <= value <= high):
            raise DamagedFile(source, f"{arch}.{key} is {value!r}: an integer from {low} to {high} is needed")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _span(indices: set[int]) -> str:
    return f"0..{max(indices)} ({len(indices)} present)" if indices else "none"


def _short(values: list) -> str:
    values = [v.item() if isinstance(v, np.generic) else v for v in values]  # 1, not np.uint32(1)
    return repr(values[0]) if len(values) == 1 else f"{values[:4]}{' ...' if len(values) > 4 else ''}"
