"""Choosing the speculator for a trunk: `choose_speculator` tries the installed speculators a
--spec-type selects, in priority order, and builds the first that can serve.

A speculator declines from its declarations alone (`requires_draft_head`, the trunk's
`speculation_refusal` / `speculation_profitable`), from its own `decline` check, by its
factory returning `specs.Decline(reason)` or raising `seams.DrafterMismatch` (the drafter
passed does not fit this trunk: its message is the reason), by its factory returning None (it
does not take the drafter loaded: a silent decline), or by asking for hidden taps the trunk
cannot serve; a factory that raises anything else is a broken plugin: it declines with the
error (logged), never taking the engine down. An explicit --spec-type that
nothing can serve is an error naming every reason (`SpeculationUnavailable`); "auto" then decodes
plainly.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs

from verispec.errors import VerispecError
from verispec.install_hints import install_hint
from verispec.registry import SPEC_TYPE_GROUPS, Entry, Registry
from verispec.seams import DraftHeadKind, DrafterMismatch, UnsupportedTap, declared
from verispec.specs import Decline, DraftFileSpec, SpeculatorSpec, resolve

logger = logging.getLogger(__name__)


@attrs.frozen
class Choice:
    """The speculator `choose_speculator` built, or None to decode plainly, and why."""

    #: the built Speculator, or None: decode plainly.
    speculator: Any
    #: its registered name (None when decoding plainly).
    name: str | None
    #: one operator-facing line: which and why, or why none.
    reason: str
    #: speculator name -> why it declined, for those tried before the pick.
    declines: dict[str, str]
    #: the names among `declines` whose factory returned None: they do not take the loaded
    #: drafter (a fit, not a fault).
    not_taken: frozenset[str] = frozenset()
    #: the names among `declines` whose reason is the plugin's own (its decline check, a
    #: `Decline`, a `DrafterMismatch`, a failed build), not one of its declarations': what
    #: `verispec generate` shows when another speculator was picked.
    own_reasons: frozenset[str] = frozenset()
    #: why the drafter --draft-model loaded drafts for nobody (the engine warns with it), or None:
    #: no --draft-model, or the speculator picked drives it.
    unused_drafter: str | None = None


class SpeculationUnavailable(VerispecError, RuntimeError):
    """An explicit --spec-type that no installed speculator can serve for this trunk."""

    def __init__(self, spec_type: str, reasons: Mapping[str, str]):
        self.spec_type, self.reasons = spec_type, dict(reasons)
        super().__init__(f"--spec-type {spec_type} cannot be served: {_reasons(self.reasons)}; pick another "
                         "--spec-type, or auto (the best that can serve, else plain decoding)")


def choose_speculator(registry: Registry, spec_type: str, trunk: Any, *, draft_head: Any = None,
                      draft_model: str | None = None, max_draft_tokens: int,
                      min_draft_prob: float | None = None) -> Choice:
    """Build the speculator `spec_type` selects for `trunk` among those `registry` holds.

    spec_type: "auto" (highest priority that can serve), "draft-head" (any that requires a
    draft head), "block" (those, with a BLOCK head) or a registered name.
    draft_head: what --draft-model loaded (or the trunk's own head); draft_model: the
    --draft-model value itself (a path or alias), when given: a drafter file whose format
    (`DraftFileSpec.speculators`) names the speculators that drive it puts them first for
    auto, draft-head and block, whatever their priority.
    min_draft_prob: None means each speculator's default_min_draft_prob.
    Returns a Choice; with "auto" and nothing serving, Choice(speculator=None, ...).
    Raises SpeculationUnavailable when an explicit spec_type cannot be served.
    """
    declines: dict[str, str] = {}
    not_taken: set[str] = set()
    own_reasons: set[str] = set()
    draft_file = draft_file_of(registry, draft_model) if draft_head is not None else None

    def choice(speculator, name, reason) -> Choice:
        unused = None
        if draft_model is not None and draft_head is not None:
            unused = unused_drafter_reason(registry, draft_head, declines, frozenset(not_taken),
                                           draft_file=draft_file, spec_type=spec_type, picked=name)
        return Choice(speculator, name, reason, declines, frozenset(not_taken), frozenset(own_reasons), unused)

    candidates = _drivers_first(registry, _candidates(registry, spec_type), spec_type, draft_file)
    if spec_type == "block" and declared(trunk, "speculation_refusal") is None:
        missing = _no_block_head(draft_head)
        if missing:  # one reason for the whole group, under the name asked for
            raise SpeculationUnavailable(spec_type, {spec_type: missing})
    for entry in candidates:
        reason = _precheck(entry.spec, spec_type, trunk, draft_head, registry)
        speculator = None
        if reason is None:
            speculator, reason = _build(entry.spec, trunk, draft_head, max_draft_tokens, min_draft_prob)
            if speculator is None and reason is None:  # its factory does not take this drafter
                reason = _not_taken(entry.name, draft_head)
                not_taken.add(entry.name)
            elif speculator is None:
                own_reasons.add(entry.name)
        if speculator is not None:
            return choice(speculator, entry.name, _picked(entry.spec, spec_type, declines, draft_file))
        declines[entry.name] = reason
    if spec_type != "auto":
        raise SpeculationUnavailable(spec_type, declines)
    why = (_reasons(declines) if declines
           else f"no speculator plugin is installed, e.g. {install_hint('plugins/ngram')}")
    reason = f"decoding plainly: nothing can serve this trunk ({why})"
    logger.info(reason)
    return choice(None, None, reason)


def draft_file_of(registry: Registry, draft_model: str | None) -> DraftFileSpec | None:
    """The drafter file format (`DraftFileSpec`) of a --draft-model file, by its GGUF
    `general.architecture`; None without --draft-model or for a model family's file (a whole
    model drafting)."""
    if draft_model is None:
        return None
    from verispec.gguf.io import read_architecture
    from verispec.model_files import resolve_model_path

    spec = registry.drafter_for_architecture(read_architecture(resolve_model_path(draft_model, registry,
                                                                                  flag="--draft-model")))
    return spec if isinstance(spec, DraftFileSpec) else None


def _drivers_first(registry: Registry, candidates: list[Entry], spec_type: str,
                   draft_file: DraftFileSpec | None) -> list[Entry]:
    """For auto, draft-head and block: the speculators the loaded drafter file names (installed
    ones, in its order), then the others; an explicit name is left as asked."""
    if draft_file is None or spec_type not in SPEC_TYPE_GROUPS:
        return candidates
    drivers = [registry.speculators[name] for name in draft_file.speculators if name in registry.speculators]
    return drivers + [entry for entry in candidates if entry not in drivers]

def _candidates(registry: Registry, spec_type: str) -> list[Entry]:
    ranked = sorted(registry.speculators.values(), key=lambda e: (-e.spec.priority, e.name))
    installed = _names(sorted(registry.speculators))
    if spec_type == "auto":
        return ranked
    if spec_type in ("draft-head", "block"):
        group = [e for e in ranked if e.spec.requires_draft_head]
        if not group:
            raise SpeculationUnavailable(spec_type, {spec_type: (
                f"no installed speculator drafts with a draft head (installed: {installed})")})
        return group
    if spec_type in registry.speculators:
        return [registry.speculators[spec_type]]
    kept_out = [f"{e.distribution or e.plugin} ({e.error})" for e in registry.errors]
    if kept_out:  # it may be installed, and broken: say so before advising an install
        raise SpeculationUnavailable(spec_type, {spec_type: (
            f"no speculator named {spec_type!r} is registered (installed: {installed}); plugins kept out because "
            f"they failed to load: {'; '.join(kept_out)} — fix those (`verispec plugins --check`), or "
            f"{_install_advice(spec_type)}")})
    raise SpeculationUnavailable(spec_type, {spec_type: (
        f"no speculator named {spec_type!r} is installed (installed: {installed}); {_install_advice(spec_type)}")})


def _install_advice(name: str) -> str:
    """How to get speculator `name`: this repository's plugin that ships it, when one matches by
    folder name (`draft-model` -> plugins/draft_model, `mtp` -> plugins/mtp_nextn), else the generic line."""
    from verispec.install_hints import install_hint, repository_distributions

    folder = name.replace("-", "_")
    matches = [p for p in repository_distributions("plugins")
               if p.split("/")[-1] == folder or p.split("/")[-1].startswith(folder + "_")]
    return f"install it: {install_hint(matches[0])}" if len(matches) == 1 else \
        "pip install the distribution that provides it"


def _no_block_head(draft_head: Any) -> str | None:
    """Why --spec-type block cannot serve with `draft_head` (not a BLOCK head), or None."""
    head_kind = getattr(draft_head, "draft_head_kind", DraftHeadKind.NONE)
    if head_kind is DraftHeadKind.BLOCK:
        return None
    loaded = "none is loaded" if head_kind is DraftHeadKind.NONE else f"the loaded one is {head_kind.value}"
    return f"it needs a block draft head and {loaded}; pass a block drafter GGUF with --draft-model PATH"


def _precheck(spec: SpeculatorSpec, spec_type: str, trunk: Any, draft_head: Any,
              registry: Registry) -> str | None:
    """Why `spec` cannot serve, from declarations alone (nothing imported), or None."""
    refusal = declared(trunk, "speculation_refusal")
    if refusal is not None:
        return f"the trunk refuses speculation: {refusal}"
    if spec_type == "auto" and not declared(trunk, "speculation_profitable"):
        return "the trunk declares speculation unprofitable (an explicit --spec-type still runs)"
    head_kind = getattr(draft_head, "draft_head_kind", DraftHeadKind.NONE)
    if spec.requires_draft_head and head_kind is DraftHeadKind.NONE:
        return f"no draft head: {spec.name} needs a draft head and {_no_head_advice(registry, trunk)}"
    return None


def _no_head_advice(registry: Registry, trunk: Any) -> str:
    """The rest of the no-draft-head line: --draft-model only where an installed plugin loads a
    drafter file for this trunk (DraftFileSpec.trunks; a model family whose NextN/MTP head comes
    in the model file alone has none). The trunk's architecture is its tokenizer's (a loaded
    GGUF's `general.architecture`); a trunk without one is offered every format."""
    arch = getattr(getattr(trunk, "tokenizer", None), "architecture", None)
    formats = sorted(name for name, entry in registry.draft_files.items()
                     if arch is None or not entry.spec.trunks or arch in entry.spec.trunks)
    if formats:
        return (f"none is loaded for this trunk; pass a drafter file (installed formats: {', '.join(formats)}) "
                "or a draft model with --draft-model PATH|ALIAS, or use --spec-type ngram or auto")
    model = (" (or a smaller model of the same tokenizer with --draft-model PATH|ALIAS and --spec-type "
             "draft-model)") if "draft-model" in registry.speculators else ""
    return ("the model file has no NextN/MTP head, and no installed plugin loads a separate drafter file; use "
            f"--spec-type ngram or auto{model}")


def unused_drafter_reason(registry: Registry, draft_head: Any, declines: Mapping[str, str],
                          not_taken: frozenset[str] = frozenset(), *, draft_file: DraftFileSpec | None = None,
                          spec_type: str = "auto", picked: str | None = None) -> str | None:
    """Why the drafter --draft-model loaded drafts for no speculator, from a Choice's `declines`
    and `not_taken`, or None when `picked` drives it (its format names it, or it needs a draft
    head: it took the one loaded). Else: the declines of the speculators that drive it (those
    its format names, or those that need a draft head), or which ones do when --spec-type did
    not try them, or, when each of them just does not take a drafter of this kind, that no
    installed speculator does (and what to install for a draft model)."""
    drivers = draft_file.speculators if draft_file is not None else ()
    if picked is not None and (picked in drivers or registry.speculators[picked].spec.requires_draft_head):
        return None
    kind = getattr(draft_head, "draft_head_kind", DraftHeadKind.NONE)
    if drivers:
        installed = [name for name in drivers if name in registry.speculators]
        named = f"its format {draft_file.name!r} is drafted by {_names(drivers)}"
        if not installed:
            return f"{named}, and none of them is installed; pip install the distribution that provides it"
        tried = {name: declines[name] for name in installed if name in declines}
        if tried:
            return _reasons(tried)
        return f"{named}; --spec-type {spec_type} picked another: use --spec-type {installed[0]} or auto"
    takers = [name for name, entry in registry.speculators.items() if entry.spec.requires_draft_head]
    unused = {name: why for name, why in declines.items() if name in takers}
    if any(name not in not_taken for name in unused):
        return _reasons(unused)
    if kind is DraftHeadKind.MODEL and "draft-model" not in registry.speculators:
        return ("no installed speculator drafts with a draft model (a smaller model of the same tokenizer); the "
                f"draft-model speculator does, {_install_advice('draft-model')}")
    untried = sorted(name for name in takers if name not in declines)
    if untried:
        why = (f"{picked} ranks above them" if spec_type == "auto" and picked
               else f"--spec-type {spec_type} does not draft with it")
        return (f"{why}; the installed speculators that draft with a draft head are {_names(untried)} "
                "(--spec-type draft-head or block picks among them, or name one)")
    if kind is DraftHeadKind.MODEL:
        return ("no installed speculator drafts with a draft model (a smaller model of the same tokenizer); the "
                f"draft-model speculator does, {_install_advice('draft-model')}")
    return (f"no installed speculator drafts with a {kind.value} draft head; pip install the distribution that "
            "provides one")


def _not_taken(name: str, draft_head: Any) -> str:
    """A speculator's decline when its factory returned None (it does not take this drafter)."""
    kind = getattr(getattr(draft_head, "draft_head_kind", None), "value", None)
    drafter = f" with the {kind} drafter loaded (--draft-model)" if kind else ""
    return f"{name} cannot serve this trunk{drafter}"


def _build(spec: SpeculatorSpec, trunk, draft_head, max_draft_tokens, min_draft_prob):
    """(speculator, None), (None, why not), or (None, None) when the factory returned None (it
    does not take this drafter): the spec's decline check, then its factory (which may return
    a `Decline`)."""
    try:
        if spec.decline is not None:
            reason = resolve(spec.decline)(trunk)
            if reason:
                return None, reason
        speculator = resolve(spec.factory)(
            trunk, spec=spec, max_draft_tokens=max_draft_tokens, draft_head=draft_head,
            min_draft_prob=spec.default_min_draft_prob if min_draft_prob is None else min_draft_prob)
    except DrafterMismatch as exc:  # the drafter the user passed does not fit this trunk
        return None, str(exc)
    except Exception as exc:  # a broken plugin declines; it never takes the engine down
        logger.warning("speculator %r failed to build: %s", spec.name, _text(exc),
                       exc_info=os.environ.get("VERISPEC_DEBUG") == "1")  # the traceback on request
        return None, f"{spec.name} failed to build: {_text(exc)}"
    if speculator is None:
        return None, None
    if isinstance(speculator, Decline):
        return None, speculator.reason
    taps = getattr(speculator, "tap_layers", None)
    if spec.needs_hidden_state and taps is not None:
        try:
            trunk.view().tap_feature_size(taps)
        except UnsupportedTap as exc:  # its drafter reads layers this trunk does not have
            speculator.close()
            return None, f"{spec.name} asks for hidden taps the trunk cannot serve: {exc}"
    return speculator, None


def _picked(spec: SpeculatorSpec, spec_type: str, declines: dict[str, str],
            draft_file: DraftFileSpec | None = None) -> str:
    if spec_type == spec.name:
        reason = f"{spec.name}: requested by --spec-type {spec_type}"
    elif draft_file is not None and spec.name in draft_file.speculators:
        reason = f"{spec.name}: named by the {draft_file.name!r} drafter file --draft-model loaded"
    else:
        group = "" if spec_type == "auto" else f"{spec_type} "
        reason = (f"{spec.name}: the highest-priority {group}speculator that can serve this trunk "
                  f"(priority {spec.priority})")
    return f"{reason}; declined: {_reasons(declines)}" if declines else reason


def _names(names) -> str:
    return ", ".join(names) or "none"


def _reasons(reasons: Mapping[str, str]) -> str:
    return "; ".join(f"{name}: {why}" for name, why in reasons.items())


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
