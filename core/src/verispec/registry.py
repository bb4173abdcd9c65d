"""The registry: the only place that knows which algorithms and models are installed.

Fed by the entry-point group "verispec" (docs/design.md §4). Each entry point names a light hook
module; its hooks call `register(spec)` with a `SpeculatorSpec`, `TrunkSpec`,
`DraftFileSpec` or `CheckpointSpec`. Plugins load one at a time and each is all or nothing:
one whose import fails, whose hook raises, which registers a wrong type or a name already
taken is kept out whole, recorded as a `PluginError`, and the others keep working.

No torch here, not even indirectly: `verispec plugins` lists through this module, and
factories and loaders are "module:attr" strings resolved only when a speculator is built.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import importlib_metadata
import pluggy

from verispec import hookspecs
from verispec.errors import VerispecError
from verispec.install_hints import DEFAULT_CHECKPOINT_INSTALL, install_hint, repository_distributions
from verispec.specs import CheckpointSpec, DraftFileSpec, SpeculatorSpec, TrunkSpec, ref_text, resolve

logger = logging.getLogger(__name__)

#: hook -> (kind, the spec type its `register` takes), in the order hooks are called.
HOOKS: dict[str, tuple[str, type]] = {
    "register_speculators": ("speculator", SpeculatorSpec),
    "register_trunks": ("trunk", TrunkSpec),
    "register_draft_files": ("draft_file", DraftFileSpec),
    "register_checkpoints": ("checkpoint", CheckpointSpec),
}
KINDS: tuple[str, ...] = tuple(kind for kind, _ in HOOKS.values())
#: --spec-type words that select a group of speculators, so none may take them as its name.
SPEC_TYPE_GROUPS: tuple[str, ...] = ("auto", "draft-head", "block")


#: declarations listed by `verispec plugins`, per kind.
_DECLARATIONS: dict[str, tuple[str, ...]] = {
    "speculator": ("requires_draft_head", "can_arm_after_prefix_reuse", "needs_hidden_state",
                   "scores_drafts", "default_min_draft_prob", "priority", "decline"),
    "trunk": ("architectures",),
    "draft_file": ("architectures", "speculators"),
    "checkpoint": ("pip_install", "is_default", "size_bytes"),
}
#: the keys every row of `plugin_rows()` starts with; the kind's declarations follow them.
ROW_KEYS = ("distribution", "version", "plugin", "kind", "name", "summary")
#: the lazy "module:attr" references of each kind, imported by `verispec plugins --check`.
_REFERENCES: dict[str, tuple[str, ...]] = {
    "speculator": ("factory", "decline"),
    "trunk": ("loader",),
    "draft_file": ("loader",),
}


@attrs.frozen
class Entry:
    """One registered spec and where it came from."""

    #: "speculator" | "trunk" | "draft_file" | "checkpoint".
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


class UnknownArchitecture(VerispecError, LookupError):
    """No installed package loads GGUF files of this `general.architecture`."""

    def __init__(self, arch: str, known, *, kind: str = "trunk"):
        self.arch, self.known, self.kind = arch, tuple(known), kind
        if kind == "drafter":
            what, fix = "drafter files or models", ("--draft-model takes a drafter file or a model of the trunk's "
                                                    "tokenizer; install the package that loads this architecture")
        else:
            families = repository_distributions("models") or ["models/gemma4", "models/llama"]
            what, fix = "models", ("install a model package that loads it; the verispec repository's model "
                                   "families: " + install_hint(*families))
        super().__init__(f"no installed package loads {what} with general.architecture={arch!r} "
                         f"(installed: {_names(self.known)}); {fix}")


class UnknownCheckpoint(VerispecError, LookupError):
    """--model (or `flag`) names no registered checkpoint."""

    def __init__(self, alias: str, known, flag: str = "--model"):
        self.alias, self.known = alias, tuple(known)
        super().__init__(f"no checkpoint alias {alias!r} is registered (registered by the installed packages: "
                         f"{_names(self.known)}; a registered one may still need its files installed); "
                         f"pass a GGUF file path to {flag}, or pip install the package that registers {alias!r}")


class NoDefaultCheckpoint(VerispecError, LookupError):
    """No installed package registers the default checkpoint."""

    def __init__(self, known):
        self.known = tuple(known)
        super().__init__(f"no installed package provides the default model; {DEFAULT_CHECKPOINT_INSTALL}, "
                         f"or pass --model NAME|PATH (installed checkpoints: {_names(self.known)})")


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
    def trunks(self) -> Mapping[str, Entry]:
        return self._entries["trunk"]

    @property
    def draft_files(self) -> Mapping[str, Entry]:
        return self._entries["draft_file"]

    @property
    def checkpoints(self) -> Mapping[str, Entry]:
        return self._entries["checkpoint"]

    @property
    def errors(self) -> list[PluginError]:
        return list(self._errors)

    def trunk_for_architecture(self, arch: str) -> TrunkSpec:
        """The TrunkSpec that loads GGUF `general.architecture` == arch; raises UnknownArchitecture."""
        return self._for_architecture(("trunk",), arch, "trunk")

    def drafter_for_architecture(self, arch: str) -> DraftFileSpec | TrunkSpec:
        """What a --draft-model file of `arch` is: the DraftFileSpec of a drafter format, else the
        TrunkSpec of a model family (a whole model drafting); raises UnknownArchitecture naming both."""
        return self._for_architecture(("draft_file", "trunk"), arch, "drafter")

    def _for_architecture(self, kinds: tuple[str, ...], arch: str, error_kind: str):
        entries = [entry for kind in kinds for entry in self._entries[kind].values()]
        for entry in entries:
            if arch in entry.spec.architectures:
                return entry.spec
        known = sorted({a for entry in entries for a in entry.spec.architectures})
        raise UnknownArchitecture(arch, known, kind=error_kind)

    def checkpoint(self, alias: str, flag: str = "--model") -> CheckpointSpec:
        """The CheckpointSpec registered as `alias`; raises UnknownCheckpoint (naming `flag`)."""
        entry = self.checkpoints.get(alias)
        if entry is None:
            raise UnknownCheckpoint(alias, sorted(self.checkpoints), flag)
        return entry.spec

    def default_checkpoint(self) -> CheckpointSpec:
        """The checkpoint marked is_default; raises NoDefaultCheckpoint with the pip line."""
        for entry in self.checkpoints.values():
            if entry.spec.is_default:
                return entry.spec
        raise NoDefaultCheckpoint(sorted(self.checkpoints))

    # -- listing ---------------------------------------------------------------------------

    def plugin_rows(self) -> list[dict]:
        """One JSON-ready row per registered spec, plus one kind="error" row per broken plugin."""
        rows = [_row(entry) for kind in KINDS for entry in self._entries[kind].values()]
        rows += [{"distribution": e.distribution, "version": e.version, "plugin": e.plugin, "kind": "error",
                  "name": None, "summary": None, "error": e.error} for e in self._errors]
        order = {kind: i for i, kind in enumerate((*KINDS, "error"))}
        return sorted(rows, key=lambda r: (r["distribution"] or "", r["plugin"], order[r["kind"]],
                                           r["name"] or ""))

    def check_references(self) -> list[dict]:
        """`verispec plugins --check`: import every lazy reference (a speculator's factory and
        decline check, a trunk's or drafter file's loader) of every registered spec, as building
        would. One JSON-ready row per reference, with "error" None when it imports to a callable;
        plus one row per plugin kept out (its import or hook failed). Imports torch where the
        plugins' modules do."""
        rows = []
        for kind in KINDS:
            for entry in self._entries[kind].values():
                for field in _REFERENCES.get(kind, ()):
                    ref = getattr(entry.spec, field)
                    if ref is not None:
                        rows.append({**_origin_row(entry.origin), "kind": kind, "name": entry.name,
                                     "field": field, "reference": ref_text(ref), "error": _import_problem(ref)})
        rows += [{**_origin_row((e.plugin, e.distribution, e.version)), "kind": "error", "name": None,
                  "field": None, "reference": None, "error": e.error} for e in self._errors]
        return rows


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
            logger.warning("verispec: %s skipped: %s", origin_text(origin), problem)
            self.errors.append(PluginError(name, distribution, version, problem))

    def _add(self, origin: tuple, load: Callable[[], Any]) -> str | None:
        """Load, register and call one plugin; returns why it was kept out, or None."""
        name = origin[0]
        if self.pm.has_plugin(name):
            return f"plugin name {name!r} is already taken by {origin_text(self.origins[name])}"
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
                return f"{entry.kind} name {entry.name!r} is already taken by {origin_text(other.origin)}"
            shared = sorted(set(getattr(entry.spec, "architectures", ()))
                            & set(getattr(other.spec, "architectures", ())))
            if shared:
                return (f"{entry.kind} {entry.name!r}: architecture {', '.join(shared)} is already loaded by "
                        f"{entry.kind} {other.name!r} from {origin_text(other.origin)}")
            if getattr(entry.spec, "is_default", False) and other.spec.is_default:
                return (f"checkpoint {entry.name!r}: the default is already {other.name!r} "
                        f"from {origin_text(other.origin)}")
        return None


def _row(entry: Entry) -> dict:
    row = dict(zip(ROW_KEYS, (entry.distribution, entry.version, entry.plugin, entry.kind, entry.name,
                             entry.spec.summary)))
    for key in _DECLARATIONS[entry.kind]:
        value = getattr(entry.spec, key)
        row[key] = list(value) if isinstance(value, tuple) else ref_text(value) if key == "decline" else value
    return row


def _import_problem(ref) -> str | None:
    """Why `ref` does not resolve to a callable (the exception, as text), or None."""
    try:
        obj = resolve(ref)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised is the plugin's problem
        return _text(exc)
    return None if callable(obj) else f"{ref_text(ref)} is a {type(obj).__name__}, not a callable"


def _origin_row(origin: tuple) -> dict:
    return dict(zip(("plugin", "distribution", "version"), origin))


def _load_order(ep) -> bool:
    """Sort key: verispec's own distributions first; otherwise the environment's order (sys.path)."""
    dist = ep.dist.name if ep.dist else ""
    return not (dist == "verispec" or dist.startswith("verispec-"))


def origin_text(origin: tuple) -> str:
    """A plugin as messages name it: "plugin 'ngram' (verispec-ngram 0.1.0)"."""
    plugin, distribution, version = origin
    return f"plugin {plugin!r}" + (f" ({distribution} {version})" if distribution else "")


def _names(names) -> str:
    return ", ".join(names) or "none"


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
