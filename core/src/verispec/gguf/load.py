"""GGUF -> a family module's state dict, driven by the family's typed tensor table.

A model family keeps only its data: a table of `Tensor` entries (GGUF name -> our parameter
name) and its config reading. It builds its module on the meta device and calls

    plan = plan_weights(gguf, model, TENSORS, num_layers=config.num_hidden_layers)
    plan.load(dtype=dtype, layout="llama", use_cache=use_cache, progress=progress)

`plan_weights` walks the module's state dict and, for every entry, finds its table row and
picks the GGUF source present in the file (in the `gguf` weight mode it first gives each
placeholder linear the class for its source's ggml types, `weights.gguf_mode.resolve_gguf_linears`: a
stack whose parts need different classes becomes a `PartwiseLinear`, one linear per run);
`WeightPlan.check` (run by `load`) refuses a missing
(gguf.errors.MissingTensor) or misshapen (BadTensorShape, via `GGUFFile.expect_shape`) tensor
before any conversion starts. `WeightPlan.convert` reads each source (dequantised to fp32 by
`GGUFFile.tensor`) and decides its dtype:
- the weight of a linear (`weights.quant.Float32Linear` and subclasses) is converted to that
  linear's weight dtype by `type(module).from_float(tensor)`; its state entries (`weight`,
  int8 `scales`, int4 `packed`/`nibbles`/`scales_zeros`) are what that module holds;
- a linear whose class has `from_gguf` (the `gguf` weight mode's weights.block_linear classes) gets the
  stored blocks instead (`weights.gguf_blocks.GGUFBlocks`: ggml type + raw bytes, stacked parts
  and expert slices as for fp32), so the file's quantised values reach it unrequantised;
- everything else (norms, biases, scales, scalars) stays fp32 as stored.
`WeightPlan.load` goes through `verispec.weight_cache.cached_state` (the next load
memory-maps the converted state; the key holds the module's state layout, `structure_key`, so a
state converted for another layout, e.g. unfused q/k/v, is never read back) and fills the
module with `load_state_dict(assign=True)`.

The table's entries: `gguf.table` (Tensor, Stack).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from gguf.constants import GGMLQuantizationType
from torch import nn

from verispec.gguf.checks import check_drafter_values, check_finite, check_numbers
from verispec.gguf.io import GGUFFile
from verispec.gguf.table import Tensor, TensorSource, expand_table
from verispec.weights.gguf_blocks import BLOCK_FORMATS, GGUFBlocks, unpack
from verispec.weights.gguf_mode import resolve_gguf_linears
from verispec.weights.quant import Float32Linear, PartwiseLinear
from verispec.weight_cache import cached_state

__all__ = ["Arch", "UnmappedParameter", "WeightPlan", "load_trunk", "plan_weights"]


class UnmappedParameter(LookupError):
    """The module has a state entry its family's tensor table does not fill (a table bug)."""

    def __init__(self, name: str, module: str, architecture: str | None):
        self.name, self.module, self.architecture = name, module, architecture
        super().__init__(f"{module} has state entry {name!r}, but the {architecture!r} tensor table has no "
                         "Tensor(...) entry whose state_name is it; add one to the family's table")


@attrs.frozen
class _Job:
    linear: Float32Linear | None  # the linear whose weight this is; None: stays fp32
    parts: tuple[str, ...] | None  # the chosen source; None: optional, absent, default kept
    part_shapes: tuple[tuple[int, ...], ...]  # torch-order shape of each part, in order
    expert: int | None
    default: torch.Tensor | None  # the module's value, kept when parts is None


@attrs.frozen(eq=False)
class WeightPlan:
    """Every state entry of `model` with the GGUF tensors it is read from. Built by
    `plan_weights`; `check` validates the file, `convert` reads, `load` caches and fills."""

    gguf: GGUFFile
    model: nn.Module
    jobs: dict[str, _Job]

    @property
    def gguf_names(self) -> frozenset[str]:
        """Every GGUF tensor this plan reads: the chosen source of each entry (the first one
        when none is present), nothing for an absent optional entry. A family that refuses
        files with tensors it would not use compares this with the file's tensor names."""
        return frozenset(name for job in self.jobs.values() for name in job.parts or ())

    def unused_tensors(self, read_elsewhere: Iterable[str] = ()) -> list[str]:
        """The file's tensors neither this plan nor the family (`read_elsewhere`, e.g. rope_freqs
        read into the config) reads, sorted: a family refuses such a file as another variant."""
        return sorted(set(self.gguf) - self.gguf_names - set(read_elsewhere))

    def check(self) -> None:
        """Every tensor the plan reads is in the file with the expected shape.
        Raises MissingTensor (naming the first absent tensor of the entry's first source, the
        architecture and the file), BadTensorShape."""
        for job in self.jobs.values():
            for part, shape in zip(job.parts or (), job.part_shapes):
                self.gguf.expect_shape(part, shape)

    def convert(self, progress: bool | None = None, *, finite: bool | str = False) -> dict[str, torch.Tensor]:
        """The model's state dict read from the file, no cache: for each linear, the entries of
        `type(linear).from_float(weight)` (fp32 / bf16 [out, in], int8 [out, in'] + bf16 scales
        [out], int4 packed groups: see weights.quant), or of `from_gguf(blocks)` when the class has
        it (the stored blocks of each stacked part, an expert's slice); every other entry fp32
        in its module's shape
        (an absent optional entry: a copy of the module's default).

        progress: tqdm bar (None: on a terminal, after a second).
        finite: refuse a non-finite value as it is read (a draft head's file: checks.check_drafter_values
          on each dequantised tensor, or on a block linear's scales), naming the GGUF tensor; True:
          every tensor, a str: those whose state names start with it (a trunk file's draft head).
        Raises what `check` raises, gguf.errors.UnsupportedTensorType, errors.DamagedFile (finite)."""
        from tqdm.auto import tqdm

        self.check()
        state: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, ...], list[torch.Tensor]] = {}  # the last 3-D source, dequantised once
        for name, job in tqdm(self.jobs.items(), desc="converting weights", unit="tensor",
                              disable=None if progress is None else not progress, delay=1.0):
            checked = finite if isinstance(finite, bool) else name.startswith(finite)
            if job.parts is None:
                state[name] = job.default.clone()
            elif job.linear is not None and hasattr(type(job.linear), "from_gguf"):
                blocks = [self._blocks(part, job.expert) for part in job.parts]
                entries = _prefixed(name, type(job.linear).from_gguf(blocks))
                if checked:  # the scales as the kernel multiplies them (a K type keeps d and sc apart, as bytes)
                    for part, stored in zip(job.parts, blocks):
                        unpacked = unpack(stored) if stored.ggml_type in BLOCK_FORMATS else None
                        for values in ((unpacked.s, unpacked.m) if unpacked is not None else entries.values()):
                            if values is not None:
                                check_drafter_values(self.gguf.path, part, values, of="block scales")
                state |= entries
            else:
                if job.expert is None:
                    tensors = [self._read(part, checked) for part in job.parts]
                else:
                    if job.parts not in experts:
                        experts = {job.parts: [self._read(part, checked) for part in job.parts]}
                    tensors = [stacked[job.expert] for stacked in experts[job.parts]]
                tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
                if job.linear is None:
                    state[name] = tensor.float()
                else:
                    state |= _prefixed(name, type(job.linear).from_float(tensor))
        return state

    def _read(self, part: str, finite: bool) -> torch.Tensor:
        """GGUF tensor `part` dequantised; with `finite`, refused when it holds a NaN or an infinity."""
        values = self.gguf.tensor(part)
        if finite:
            check_drafter_values(self.gguf.path, part, values)
        return values

    def _blocks(self, part: str, expert: int | None) -> GGUFBlocks:
        """The stored blocks of a 2-D part, or of expert `expert`'s slice of a 3-D one."""
        raw, ggml_type, shape = self.gguf.raw_tensor(part)
        raw = raw if expert is None else raw[expert]
        return GGUFBlocks.from_raw(raw, ggml_type, shape)

    def load(self, *, dtype: str, layout: str, use_cache: bool = True, progress: bool | None = None,
             finite: bool | str = False) -> None:
        """Fill the model: `check`, the converted state from `weight_cache.cached_state` (read
        back from the cache, else `convert`ed and saved), `load_state_dict(assign=True)`, then
        eval mode.

        dtype: the canonical weight dtype the model was built with (part of the cache key).
        layout: the family's tag for its converted layout (part of the cache key).
        finite: `convert`'s (draft heads' loaders pass True; a state is cached only once converted,
          so a cached one passed the check).
        Raises what `convert` raises."""
        self.check()
        state = cached_state(self.gguf, dtype, lambda: self.convert(progress, finite=finite),
                             use_cache=use_cache, layout=f"{layout}/{structure_key(self.model)}")
        self.model.load_state_dict(state, assign=True)
        self.model.eval()


def structure_key(model: nn.Module) -> str:
    """sha256 (16 hex digits) of `model`'s state entries (name, shape, dtype): part of the weight
    cache key, so a converted state saved for another module layout (separate q/k/v linears
    before they were fused, another class for a linear) is never read into this one."""
    entries = [(name, list(value.shape), str(value.dtype)) for name, value in model.state_dict().items()]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def _prefixed(weight_name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state entries named as the entries of the linear whose weight is `weight_name`."""
    prefix = weight_name.rpartition(".")[0]
    return {f"{prefix}.{key}": value for key, value in module.state_dict().items()}


def plan_weights(gguf: GGUFFile, model: nn.Module, table: Iterable[Tensor], *, num_layers: int,
                 num_experts: int = 0) -> WeightPlan:
    """Match every state entry of `model` (built on the meta device) to its source in `gguf`:
    the first source whose tensors are all in the file. Nothing is read or checked yet
    (`WeightPlan.check`), so a family can first refuse a file for what else it holds.

    GGUFLinear placeholders (`gguf` weight mode) first become the class for the ggml types of
    their first present source (weights.gguf_mode.resolve_gguf_linears; parts of mixed classes become a
    PartwiseLinear whose linears `<linear>.0`, `<linear>.1`, ... each read their run of parts).
    A linear's entries are planned as one tensor, `<linear>.weight`, of shape
    [out_features, in_features]; every other entry has its module's shape. A stacked source's
    parts take the rows their owning module declares (`Stack`), else an equal share; a
    per-expert part is [num_experts, *shape].
    Raises UnmappedParameter for a state entry the table does not fill, weights.gguf_mode.UnmappedGGUFType
    for a `gguf`-mode linear stored in a type that mode has no mapping for, ValueError for an
    optional entry absent from the file whose module has no default value (a linear, or a
    meta tensor), for rows a stack cannot share evenly and for declared rows that do not fit.
    """
    sources = expand_table(table, num_layers, num_experts)
    resolve_gguf_linears(model, lambda prefix: _part_types(gguf, sources.get(f"{prefix}.weight")),
                         lambda prefix: _declared_rows(model, prefix))
    for prefix, module in model.named_modules():
        if isinstance(module, PartwiseLinear) and f"{prefix}.weight" in sources:
            _split_source(gguf, sources, prefix, module)
    linears = {prefix: m for prefix, m in model.named_modules() if isinstance(m, Float32Linear)}
    jobs: dict[str, _Job] = {}
    for name, value in model.state_dict().items():
        prefix = name.rpartition(".")[0]
        linear = linears.get(prefix)
        if linear is not None:
            name, shape = f"{prefix}.weight", (linear.out_features, linear.in_features)
            if name in jobs:  # a linear's other entries (scales, ...) come with its weight
                continue
        else:
            shape = tuple(value.shape)
        source = sources.get(name)
        if source is None:
            raise UnmappedParameter(name, type(model).__name__, gguf.get("general.architecture"))
        parts = next((parts for parts in source.alternatives if all(p in gguf for p in parts)),
                     None if source.optional else source.alternatives[0])
        if parts is None and (linear is not None or value.is_meta):
            raise ValueError(f"{name!r} is optional and absent from {gguf.path}, but the module has no "
                             "default value for it (built on the meta device); make the entry required")
        declared = _declared_rows(model, name if linear is None else prefix)
        part_shapes = _part_shapes(name, shape, parts, declared, source.expert, num_experts)
        jobs[name] = _Job(linear, parts, part_shapes, source.expert, value if parts is None else None)
    return WeightPlan(gguf, model, jobs)


def _part_types(gguf: GGUFFile, source: TensorSource | None) -> dict[str, GGMLQuantizationType]:
    """GGUF name -> ggml type of the first alternative present in `gguf` (none present: empty,
    and the planning that follows refuses the entry by name)."""
    for parts in source.alternatives if source is not None else ():
        if all(p in gguf for p in parts):
            return {p: gguf.tensor_info(p).ggml_type for p in parts}
    return {}


def _declared_rows(model: nn.Module, name: str) -> tuple[int, ...] | None:
    """The rows per stacked part that the module owning `name` (a linear's module name, or a
    parameter's state name) declares in its `part_rows`, or None."""
    owner, _, leaf = name.rpartition(".")
    rows = getattr(model.get_submodule(owner), "part_rows", None) or {}
    return tuple(rows[leaf]) if leaf in rows else None


def _split_source(gguf: GGUFFile, sources: dict[str, TensorSource], prefix: str,
                  module: PartwiseLinear) -> None:
    """Replace the source of a PartwiseLinear's weight by one per linear in it: its run of the
    first present alternative's parts (the one whose types made the runs)."""
    source = sources.pop(f"{prefix}.weight")
    parts = next(parts for parts in source.alternatives if all(p in gguf for p in parts))
    start = 0
    for j in range(len(module)):
        count = len(module.part_rows.get(str(j), (0,)))
        sources[f"{prefix}.{j}.weight"] = TensorSource((parts[start:start + count],), False, source.expert)
        start += count


def _part_shapes(name: str, shape: tuple[int, ...], parts: tuple[str, ...] | None,
                 declared: Sequence[int] | None, expert: int | None,
                 num_experts: int) -> tuple[tuple[int, ...], ...]:
    """The torch-order shape each GGUF part of a `shape` entry must have: a stack's parts take
    the `declared` rows (their sum must be the entry's), else an equal share."""
    if parts is None:
        return ()
    if len(parts) == 1:
        shapes = (shape,)
    elif declared is not None:
        if len(declared) != len(parts) or sum(declared) != shape[0]:
            raise ValueError(f"{name!r} has {shape[0]} rows, which its module declares as {tuple(declared)} "
                             f"for {len(parts)} stacked parts {parts}")
        shapes = tuple((rows, *shape[1:]) for rows in declared)
    else:
        rows, left = divmod(shape[0], len(parts))
        if left:
            raise ValueError(f"{name!r} has {shape[0]} rows, which {len(parts)} stacked parts cannot share")
        shapes = ((rows, *shape[1:]),) * len(parts)
    return shapes if expert is None else tuple((num_experts, *s) for s in shapes)


@attrs.frozen
class Arch:
    """One architecture a family loads, as data for `load_trunk`.

    config: `gguf -> config` (the family's reader; the config has `num_hidden_layers`, and
      `num_experts` when its table has per-expert rows).
    model: the trunk class, called as `model(config, dtype=..., **options)`, built on meta.
    tensors: the tensor table, or `config -> table` when it depends on the config.
    layout: the family's tag for its converted layout (weight cache key).
    family: the name the unused-tensor refusal gives the math ("llama/qwen2").
    read_elsewhere: tensors the config reads (e.g. rope_freqs), not the plan.
    default_dtype: the weight dtype when the caller chooses none (weights.gguf_mode.default_dtype
      turns "gguf" into int8 where the C kernels are not built).
    check_kind: `gguf -> None`, raising the family's UnsupportedVariant for a file of this
      architecture that is no trunk (e.g. a standalone MTP head); run before `check_numbers`,
      whose block-count rule such a file would break with a misleading "damaged" message.
    ignored: `config -> tensor names` the file may hold and the math deliberately does not read
      (llama.cpp skips them too, e.g. GLM-5.2's indexer on layers that reuse another's
      selection); not refused as unused.
    draft_head: the state-name prefix of a draft head the file may carry (a NextN / MTP block,
      "mtp."): its tensors are checked for NaN and infinities as they convert, as a drafter
      file's are (a damaged head drafts junk without a word; the trunk's own weights are
      checked when a forward's logits are unusable). Costs one isfinite pass over the head's
      dequantised tensors on the first load (the converted state is cached after it).
    """

    config: Callable[[GGUFFile], Any]
    model: Callable[..., nn.Module]
    tensors: tuple[Tensor, ...] | Callable[[Any], tuple[Tensor, ...]]
    layout: str
    family: str
    read_elsewhere: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    default_dtype: str = "int8"
    check_kind: Callable[[GGUFFile], None] | None = None
    ignored: Callable[[Any], Iterable[str]] | None = None
    draft_head: str | None = None


def load_trunk(path: str | os.PathLike, archs: Mapping[str, Arch], *, dtype: str | None = None,
               use_cache: bool = True, tokenizer: bool = True, progress: bool | None = None,
               shards=None, splits=None, **options) -> nn.Module:
    """Open → config → model → `plan_weights` → refuse unused tensors → load → tokenizer.

    archs: `general.architecture` -> its `Arch`. options: passed to the model class
    (context_length, max_rows_per_forward, ...). shards, splits: one rank of a tensor-parallel
    group (nn.parallel.Shards) and the family's `gguf.shard.Split`s (a list, or config -> list):
    the model is built with `shards=`, its weights planned on that rank's `gguf.shard.ShardedGGUF`
    and cached per rank; raises nn.parallel.HeadsNotDivisible, gguf.shard.ShardNotBlockAligned. Returns the trunk in eval mode with
    `.tokenizer` (when `tokenizer`) and `.check_weights` (`check_finite` of the file: the seam's
    declaration, run when a forward's logits are unusable). Before the config is read, `check_numbers` refuses a file
    whose sizes contradict its tensors, so nothing is allocated per layer for a count the file
    does not back.
    Raises gguf.errors, errors.UnsupportedArchitecture, errors.DamagedFile,
    errors.UnusedTensors (naming the tensors), the family's UnsupportedVariant subclass,
    weights.quant.UnknownWeightDtype."""
    from verispec.errors import UnsupportedArchitecture, UnusedTensors
    from verispec.weights.gguf_mode import default_dtype
    from verispec.weights.quant import canonical_dtype

    path = os.fspath(path)
    gguf = GGUFFile.open(path)
    arch = archs.get(gguf.architecture)
    if arch is None:
        raise UnsupportedArchitecture(path, gguf.architecture, tuple(archs))
    dtype = canonical_dtype(dtype or default_dtype(arch.default_dtype))
    if arch.check_kind is not None:
        arch.check_kind(gguf)
    check_numbers(gguf)
    config = arch.config(gguf)
    source, layout = gguf, arch.layout
    if shards is not None:
        from verispec.gguf.shard import ShardedGGUF

        options["shards"] = shards
        source = ShardedGGUF(gguf, splits(config) if callable(splits) else splits, shards)
        layout = f"{arch.layout}/tp{shards.rank}of{shards.world_size}"
    model = arch.model(config, dtype=dtype, **options)
    table = arch.tensors(config) if callable(arch.tensors) else arch.tensors
    plan = plan_weights(source, model, table, num_layers=config.num_hidden_layers,
                        num_experts=getattr(config, "num_experts", 0))
    ignored = set(arch.ignored(config)) if arch.ignored is not None else set()
    unused = plan.unused_tensors(read_elsewhere=arch.read_elsewhere | ignored)
    if unused:
        raise UnusedTensors(path, arch.family, unused)
    plan.load(dtype=dtype, layout=layout, use_cache=use_cache, progress=progress, finite=arch.draft_head or False)
    model.check_weights = functools.partial(check_finite, gguf)  # the seam's `check_weights` declaration
    if tokenizer:
        from verispec.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_gguf(gguf)
    return model
