"""A family's tensor table: typed rows saying where each state entry of its module comes from.

Table entries, all typed (no syntax inside names beyond the `str.format` fields):

    Tensor("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight")   # one per layer
    Tensor("blk.{i}.layer_output_scale.weight", "model.layers.{i}.layer_scalar",
           optional=True)                            # absent: the module's default is kept
    Tensor("blk.{i}.ffn_gate_up_exps.weight", "model.layers.{i}.experts.gate_up_proj.{e}.weight",
           per_expert=True,                          # expert e's slice of a 3-D [E, rows, cols]
           alternatives=(Stack("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),))
    Tensor(Stack("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
           "model.layers.{i}.self_attn.qkv_proj.weight")  # one fused linear; unequal parts: the
                                                    # owning module's part_rows = {"qkv_proj": (...)}

"{i}" expands per layer (it must appear in the state name and every source name, or in none);
"{e}" in the state name expands per expert (exactly when `per_expert`). Entries whose state name the
module does not have (a tied LM head, a KV-shared layer's k_proj) are never looked up.
"""
from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = ["Stack", "Tensor", "TensorSource", "expand_table", "parts"]


@attrs.frozen(init=False)
class Stack:
    """GGUF tensors concatenated along rows (dim 0), in order, into one parameter: e.g. separate
    gate and up projections read as one fused gate|up weight, or q, k and v as one q|k|v.
    The parts' rows sum to the parameter's, their other dims equal its. Each part holds the
    rows the module owning the entry declares in its `part_rows` (a dict: the child linear's
    or parameter's own name -> rows per part, e.g. {"qkv_proj": (H·Dh, Hkv·Dh, Hkv·Dh)}),
    else an equal share; `WeightPlan.check` names the part whose shape is not that."""

    parts: tuple[str, ...]

    def __init__(self, *parts: str):
        if len(parts) < 2 or not all(isinstance(p, str) for p in parts):
            raise TypeError(f"Stack takes two or more GGUF tensor names, got {parts!r}")
        self.__attrs_init__(tuple(parts))


def parts(source: str | Stack) -> tuple[str, ...]:
    return source.parts if isinstance(source, Stack) else (source,)


def _check_source(_, attribute, value) -> None:
    if not isinstance(value, (str, Stack)):
        raise TypeError(f"Tensor.{attribute.name}: a GGUF name or a Stack, got {value!r}")


@attrs.frozen
class Tensor:
    """One row of a family's tensor table: where the state entry `state_name` comes from.

    source: a GGUF tensor name, or a `Stack` of names concatenated along rows.
    state_name: our state-dict name (HF-style), e.g. "model.layers.{i}.self_attn.q_proj.weight".
    alternatives: further sources tried in order when `source` is not in the file; the first
      one whose every part is present wins.
    optional: when no source is present, keep the module's default value (e.g. a scale of 1).
    per_expert: every GGUF part is a 3-D [E, rows, cols] tensor and `state_name` (which holds "{e}")
      takes expert e's slice [rows, cols].
    Raises TypeError / ValueError on a malformed entry (placeholders that do not line up).
    """

    source: str | Stack = attrs.field(validator=_check_source)
    state_name: str = attrs.field(validator=attrs.validators.instance_of(str))
    alternatives: tuple[str | Stack, ...] = attrs.field(
        default=(), kw_only=True, converter=tuple, validator=attrs.validators.deep_iterable(_check_source))
    optional: bool = attrs.field(default=False, kw_only=True)
    per_expert: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self):
        for name in (n for s in self.sources for n in parts(s)):
            if ("{i}" in name) != self.per_layer:
                raise ValueError(f"Tensor({name!r} -> {self.state_name!r}): '{{i}}' must be in the state name and "
                                 "every GGUF name, or in none")
            _check_format(name, i=0)
        if ("{e}" in self.state_name) != self.per_expert:
            raise ValueError(f"Tensor(-> {self.state_name!r}): the state name holds '{{e}}' exactly when "
                             "per_expert=True")
        _check_format(self.state_name, i=0, e=0)

    @property
    def per_layer(self) -> bool:
        """One state entry per layer ("{i}" in the names)."""
        return "{i}" in self.state_name

    @property
    def sources(self) -> tuple[str | Stack, ...]:
        """`source`, then the `alternatives`, in the order they are tried."""
        return (self.source, *self.alternatives)


def _check_format(name: str, **fields) -> None:
    try:
        name.format(**fields)
    except (KeyError, IndexError, ValueError):
        raise ValueError(f"{name!r}: only the fields {{i}} (layer) and {{e}} (expert, state names only) "
                         "may appear in a tensor table name") from None


@attrs.frozen
class TensorSource:
    """One state entry's concrete source after expansion (names formatted for one layer/expert).

    alternatives: tried in order; each is the GGUF names stacked along rows (one name: as is).
    expert: the slice index into each 3-D part, or None for a plain tensor.
    """

    alternatives: tuple[tuple[str, ...], ...]
    optional: bool = False
    expert: int | None = None


def expand_table(table: Iterable[Tensor], num_layers: int, num_experts: int = 0) -> dict[str, TensorSource]:
    """Our state-dict name -> its `TensorSource`, every "{i}" entry expanded for layers
    0..num_layers-1 and every per-expert entry for experts 0..num_experts-1.
    Raises ValueError when two entries fill the same name."""
    out: dict[str, TensorSource] = {}
    for entry in table:
        for i in range(num_layers) if entry.per_layer else (None,):
            alternatives = tuple(tuple(name.format(i=i) for name in parts(s)) for s in entry.sources)
            for e in range(num_experts) if entry.per_expert else (None,):
                state_name = entry.state_name.format(i=i, e=e)
                if state_name in out:
                    raise ValueError(f"two tensor table entries fill {state_name!r}")
                out[state_name] = TensorSource(alternatives, entry.optional, e)
    return out
