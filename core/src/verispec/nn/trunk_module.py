"""`TrunkModule`: the nn.Module base of the model families, on the seam `nn.trunk.SequenceTrunk` writes once.

What every family's `<Family>ForCausalLM` shares beyond the seam: its sizes from an HF-style config
(`_init_sizes`, which refuses a context past the trained positions: ContextBeyondTraining), the
weight-dtype swap and the tied or untied LM head (`_finish_linears`, `_lm_head` with the final
softcap), the vocabulary-parallel embedding rows and LM head of a tensor-parallel rank (`shards`),
the batch-invariance declaration (`spec_batch_invariant`), and placement on a device (`to_device`:
device kernels, KV pools, RoPE tables). A family writes its layers' math (`_forward_rows`) and its
per-layer state kinds (`_new_layer_states`).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.nn.parallel import embed_vocab_rows, gather_vocab
from verispec.nn.trunk import SequenceTrunk
from verispec.weights.quant import canonical_dtype, module_batch_invariant, rows_per_forward, swap_linears

log = logging.getLogger("verispec")


class ContextBeyondTraining(VerispecError, ValueError):
    """A context length asked for beyond the positions the model was trained on."""

    def __init__(self, context_length: int, trained: int):
        self.context_length, self.trained = context_length, trained
        super().__init__(
            f"--context-length {context_length} exceeds the {trained} positions this model was trained on "
            f"(its GGUF's context_length); positions past them give garbage: choose at most {trained}, "
            "or leave --context-length out to use all of them")



class TrunkModule(SequenceTrunk, nn.Module):
    """Base of the model families: an nn.Module built on the meta device from an HF-style config.

    Subclasses call `_init_sizes` first and `_finish_linears` once `self.model` (with
    `embed_tokens`) is built, set `final_logit_softcap` if the family has one, and write the
    math of `SequenceTrunk`.
    """

    tokenizer = None
    #: cap·tanh(x/cap) on the logits (Gemma); None = off.
    final_logit_softcap: float | None = None
    #: this rank of a tensor-parallel group (nn.parallel.Shards); None: the whole model. A family
    #: that sets it builds its modules with the rank's sizes (nn.parallel.shard_config) and keeps
    #: `vocab_size` the whole model's.
    shards = None
    #: the devices this family's trunk runs on (`verispec.device.require_trunk_device`); a family
    #: that adds "cuda" writes its forward with the device kernels (`to_device`) and pooled KV
    devices: tuple[str, ...] = ("cpu",)
    #: a placed trunk's KV pools, one per layer (`_place_state`); None on the CPU
    _kv_pools: list | None = None
    speculation_refusal = None
    speculation_profitable = True

    def __init__(self):
        nn.Module.__init__(self)
        SequenceTrunk.__init__(self)

    @property
    def spec_batch_invariant(self) -> bool:
        """True when every linear uses a batch-invariant kernel (weights.quant) and no forward chunk
        exceeds the kernels' invariance limit (read at each call: max_rows_per_forward may change).
        On a GPU only the GGUF block linears' kernel (kernels.triton_qmatmul) qualifies: cuBLAS
        (F.linear, the float and bf16 dtypes) and torch's int8 kernel pick their blocking by shape."""
        if self.trunk_device is not None and self.trunk_device.type != "cpu":
            from verispec.weights.block_linear import BlockLinear
            from verispec.weights.quant import Float32Linear

            return all(isinstance(m, BlockLinear) for m in self.modules()
                       if isinstance(m, (nn.Linear, Float32Linear)))
        limits = [m.max_invariant_rows for m in self.modules() if getattr(m, "max_invariant_rows", None)]
        return module_batch_invariant(self) and all(self.max_rows_per_forward <= limit for limit in limits)

    def to_device(self, device: torch.device | str) -> None:
        """Run this trunk with the device kernels, its tensors on `device`: every module with a
        `device_kernels` switch (block linears, RMSNorm, the gated MLP, a family's fused layer) set
        to its device path (Triton where `kernels.triton_dispatch.use_triton`, PyTorch statements
        elsewhere, never the C kernels), then norms, biases and float weights moved there
        (`nn.Module.to`; a block linear keeps its packed blocks on the CPU and puts one unpacked
        int8 copy on the device at first use), then `_place_state(device)` (the family's KV pools,
        RoPE tables). A trunk's own draft head (an MTP block) stays on the CPU and is switched
        off, with one warning; heads bound through `view()` read the placed trunk from the CPU.
        On the CPU this is the proof mode of the GPU path: with VERISPEC_TRITON=1
        and TRITON_INTERPRET=1 the code a CUDA trunk runs, run by Triton's interpreter. Call
        before any sequence exists.
        Raises VerispecError for a device the family does not declare (`devices`), and for the int8
        / int4 dtypes off the CPU."""
        from verispec.device import require_trunk_device

        device = torch.device(device)
        require_trunk_device(device, self)
        if device.type != "cpu" and self.dtype in ("int8", "int4"):
            raise VerispecError(f"--dtype {self.dtype} on {device.type}: its packed-integer kernels run on the CPU; "
                                f"on {device.type} use --dtype gguf (the file's blocks in Triton, the default) or "
                                "bfloat16 / float32 (cuBLAS: not batch-invariant, declared so)")
        if self._sequences:
            raise ValueError("to_device: the trunk already holds sequences; place it before the first")
        for module in self.modules():  # first: a block linear then keeps its packed blocks on the CPU
            if hasattr(type(module), "device_kernels"):
                module.device_kernels = True
        if getattr(self, "draft_head", None) is not None:  # its block is a submodule, its caches the CPU's
            log.warning("the %s draft head runs on the CPU only: it is switched off on %s (n-gram speculation "
                        "still runs)", type(self.draft_head).__name__, device.type)
            self.draft_head = None
        self.to(device)
        self.trunk_device = device
        self._nbytes_template = None
        self._place_state(device)

    def _place_state(self, device: torch.device) -> None:
        """The per-device state `to_device` makes last: for a family whose every layer attends
        (llama/qwen2, Gemma 3) a `nn.kv_pool.BlockPool` per layer, blocks of `key_block` slots
        (64 where the family sets none), and the table of every RotaryEmbedding
        (`RotaryEmbedding.tabulate`). A family with recurrent or shared-KV layers overrides it.
        Raises ValueError under `shards` (a tensor-parallel rank runs on the CPU)."""
        from verispec.nn.kv_pool import BlockPool
        from verispec.nn.rope import RotaryEmbedding

        if self.shards is not None:
            raise ValueError("a tensor-parallel rank runs on the CPU")
        c = getattr(self, "shard_config", self.config)  # a family without tensor parallelism has no shard_config
        block = getattr(self, "key_block", 64)
        self._kv_pools = [BlockPool(c.num_key_value_heads, c.head_dim, block, device) for _ in range(self.num_layers)]
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.tabulate(self.max_context_length, device)

    def _pooled_caches(self) -> list | None:
        """Each layer's `nn.kv_pool.PooledKVCache` for a new sequence of a placed trunk (one that
        `_place_state` gave pools; None for a layer without a pool), else None: a family's
        `_new_layer_states` asks first."""
        if self._kv_pools is None:
            return None
        from verispec.nn.kv_pool import PooledKVCache

        return [None if pool is None else PooledKVCache(pool, max_positions=self.max_context_length)
                for pool in self._kv_pools]

    def _init_sizes(self, config, dtype: str, max_rows_per_forward: int | None, context_length: int | None) -> None:
        """The sizes the seam reads, from an HF-style config (vocab_size, hidden_size,
        num_hidden_layers, max_position_embeddings); call first in a subclass's __init__.
        Raises ContextBeyondTraining for a context_length above max_position_embeddings."""
        self.config, self.dtype = config, canonical_dtype(dtype)
        self.vocab_size, self.hidden_size, self.num_layers = (config.vocab_size, config.hidden_size,
                                                              config.num_hidden_layers)
        trained = self.trained_context_length = int(config.max_position_embeddings)
        if context_length is not None and int(context_length) > trained:
            raise ContextBeyondTraining(int(context_length), trained)
        self.max_context_length = int(context_length or trained)
        self.max_rows_per_forward = max_rows_per_forward or rows_per_forward(self.dtype)

    def _finish_linears(self, device) -> None:
        """Add the untied LM head when the config has one (else `model.embed_tokens` serves), then
        swap every linear to the weight dtype; call once `self.model` is built."""
        c = self.config
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False,
                                                                    device=device)
        swap_linears(self, self.dtype)

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Unscaled embedding rows fp32 [n, D] of int64 tokens [n]; under `shards` the rank's
        vocabulary rows, all-reduced (nn.parallel.embed_vocab_rows: exact), so a collective."""
        if self.shards is not None:
            return embed_vocab_rows(self.model.embed_tokens, tokens, self.vocab_size, self.shards)
        return self.model.embed_tokens.rows(tokens)

    def _lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 [r, V] from normed fp32 [r, D]: tied to `model.embed_tokens` unless `self.lm_head`,
        then the softcap. Under `shards` each rank's [r, V_rank] columns are gathered into [r, V]
        first (nn.parallel.gather_vocab), so the softcap runs on the whole row, as in one process."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head(normed)
        if self.shards is not None:
            logits = gather_vocab(logits, self.vocab_size, self.shards)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
