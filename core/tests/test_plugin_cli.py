"""What a plugin author sees on the `verispec` command line (a subprocess, plugins installed as
on-disk dist-info folders): a decline's own reason, `plugins --check`, a drafter file driven by
the speculator its format names."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from verispec.testing.toy import write_toy_gguf

#: a speculator that declines the toy trunk with its own reason, ranked above every shipped one.
PICKY = """
    from verispec import Decline, SpeculatorSpec, hookimpl

    @hookimpl
    def register_speculators(register):
        register(SpeculatorSpec(name="picky", summary="declines with a reason", factory="picky_hooks:create",
                                decline="picky_hooks:decline", priority=99))

    def decline(trunk):  # the cheap check first: nothing to say here
        return None

    def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
        return Decline("the tokenizer has no newline token")
"""


#: the same speculator with a typo in its factory reference.
TYPO = """
    from verispec import SpeculatorSpec, hookimpl

    @hookimpl
    def register_speculators(register):
        register(SpeculatorSpec(name="typo", summary="a typo'd factory", factory="typo_hooks:craete"))

    def create(trunk, **kwargs):
        return None
"""


#: a third party's BLOCK head file format, naming its own speculator (the toy block head and
#: speculator underneath): the shipped dflash (priority 30) would otherwise take the head.
OWN_HEAD = """
    from verispec import DraftFileSpec, SpeculatorSpec, hookimpl

    @hookimpl
    def register_speculators(register):
        register(SpeculatorSpec(name="own-head", summary="drives own-head files", factory="own_head_hooks:create",
                                requires_draft_head=True, needs_hidden_state=True, priority=1))

    @hookimpl
    def register_draft_files(register):
        register(DraftFileSpec(name="own-head", summary="a third party's head file", architectures=("own-head",),
                               loader="own_head_hooks:load", speculators=("own-head",)))

    def load(path, trunk):
        from verispec.testing.toy_plugin import ToyBlockHead
        return ToyBlockHead(trunk.view())

    def create(trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
        from verispec.testing.toy_plugin import BlockSpeculator
        return BlockSpeculator(draft_head, spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)
"""


#: a speculator whose propose raises: a plugin fault.
FAULTY = """
    from verispec import SpeculatorSpec, hookimpl
    from verispec.seams import Speculator

    @hookimpl
    def register_speculators(register):
        register(SpeculatorSpec(name="faulty", summary="raises in propose", factory="faulty_hooks:Faulty",
                                priority=99))

    class Faulty(Speculator):
        def __init__(self, trunk, *, spec, max_draft_tokens, min_draft_prob, draft_head):
            super().__init__(spec, max_draft_tokens=max_draft_tokens, min_draft_prob=min_draft_prob)

        def propose(self, state, ctx):
            return [ctx.last_token] * (1 // (ctx.pos - ctx.pos))  # the faulting line

        def commit(self, state, tokens, hidden_rows, start_pos):
            pass
"""


def write_dist(root, dist, entry_point, modules):
    info = root / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[verispec]\n{entry_point}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def environment(root):
    return {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}


def verispec(env, *args):
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def picky_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    write_dist(root, "verispec-toy", "toy = verispec.testing.toy_plugin", {})
    write_dist(root, "picky-drafter", "picky = picky_hooks", {"picky_hooks": PICKY})
    return environment(root)


def test_a_decline_reason_reaches_the_command_line(picky_env, tmp_path):
    model = str(write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110))
    explicit = verispec(picky_env, "generate", "hello hello", "--model", model, "--spec-type", "picky")
    assert explicit.returncode == 1
    assert "--spec-type picky cannot be served: picky: the tokenizer has no newline token" in explicit.stderr
    auto = verispec(picky_env, "generate", "hello hello hello", "--model", model, "--max-tokens", "8",
                    "--spec-type", "auto")
    assert auto.returncode == 0, auto.stderr
    assert "declined before ngram: picky: the tokenizer has no newline token]" in auto.stderr
    as_json = verispec(picky_env, "generate", "hello hello hello", "--model", model, "--max-tokens", "8", "--json")
    assert json.loads(as_json.stdout)["declined"] == {"picky": "the tokenizer has no newline token"}


def test_plugins_lists_the_decline_declaration(picky_env):
    rows = json.loads(verispec(picky_env, "plugins", "--json").stdout)
    picky = next(row for row in rows if row["name"] == "picky")
    assert picky["decline"] == "picky_hooks:decline" and picky["distribution"] == "picky-drafter"
    assert "decline=picky_hooks:decline" in verispec(picky_env, "plugins").stdout


def test_plugins_check_catches_a_typod_factory_and_names_its_distribution(picky_env, tmp_path):
    """`verispec plugins` lists a typo'd factory as healthy (it imports nothing); `--check`
    imports it and fails, naming the distribution."""
    write_dist(tmp_path, "typo-drafter", "typo = typo_hooks", {"typo_hooks": TYPO})
    env = {**picky_env, "PYTHONPATH": f"{picky_env['PYTHONPATH']}{os.pathsep}{tmp_path}"}
    assert verispec(env, "plugins").returncode == 0
    r = verispec(env, "plugins", "--check")
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("plugin 'typo' (typo-drafter 0.1.0): speculator 'typo': factory 'typo_hooks:craete' does not import: "
            "AttributeError: module 'typo_hooks' has no attribute 'craete'") in r.stdout
    assert r.stdout.splitlines()[-1].endswith(": 1 problem")
    rows = json.loads(verispec(env, "plugins", "--check", "--json").stdout)
    assert [(row["distribution"], row["reference"]) for row in rows if row["error"]] == [
        ("typo-drafter", "typo_hooks:craete")]
    healthy = verispec(picky_env, "plugins", "--check")  # the shipped plugins and the picky one all import
    assert healthy.returncode == 0 and healthy.stdout.splitlines()[-1].endswith(": all import"), healthy.stdout


def test_a_third_party_drafter_file_is_driven_by_its_own_speculator(tmp_path):
    """auto and block pick the speculator the file's format names over the shipped block drafters
    (dflash, priority 30; toy-block), and nothing says the file is not used."""
    from verispec.testing.fixture_writer import write_gguf

    write_dist(tmp_path, "verispec-toy", "toy = verispec.testing.toy_plugin", {})
    write_dist(tmp_path, "own-head", "own = own_head_hooks", {"own_head_hooks": OWN_HEAD})
    env = environment(tmp_path)
    model = str(write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110))
    head = write_gguf(tmp_path / "head.gguf", arch="own-head", metadata={}, tensors={}, vocab=None)
    for spec_type in ("auto", "block"):
        r = verispec(env, "generate", "hello hello hello", "--model", model, "--draft-model", head, "--max-tokens",
                     "8", "--ignore-eos", "--spec-type", spec_type, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["speculator"] == "own-head", spec_type
        assert "is not used" not in r.stderr


def test_a_plugin_fault_shows_its_traceback_under_verispec_debug(tmp_path):
    write_dist(tmp_path, "verispec-toy", "toy = verispec.testing.toy_plugin", {})
    write_dist(tmp_path, "faulty-drafter", "faulty = faulty_hooks", {"faulty_hooks": FAULTY})
    model = str(write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110))
    args = ("generate", "hello hello hello", "--model", model, "--max-tokens", "8", "--ignore-eos",
            "--spec-adaptive", "off")  # it drafts at once, without the governor timing plain steps first
    quiet = verispec(environment(tmp_path), *args)
    assert quiet.returncode == 0, quiet.stderr
    assert "speculator 'faulty': propose raised ZeroDivisionError" in quiet.stderr and "Traceback" not in quiet.stderr
    debug = verispec({**environment(tmp_path), "VERISPEC_DEBUG": "1"}, *args)
    assert debug.returncode == 0, debug.stderr
    assert "Traceback" in debug.stderr and "faulty_hooks.py" in debug.stderr
    assert "# the faulting line" in debug.stderr
