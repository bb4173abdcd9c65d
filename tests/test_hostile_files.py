"""Hostile model files: mutants of every installed trunk family's tiny fixture (tests/conftest.py)
are refused as bad input, in bounded time and memory.

The mutants: the file cut at every section boundary (header fields, each metadata entry, each
tensor record, the data start, each tensor's data), huge and zero counts and sizes (block_count
10^9, zero heads, ...), per-layer lists one entry short, KV sharing with no layer to share from,
non-finite or out-of-range float keys, a token list shorter than the vocabulary, bos/eos ids
outside it, and NaN / infinite weights. Each must be refused with an
errors.VerispecError naming the problem (the key, the tensor, the cut), and `verispec generate`
must exit 1 with that one line on stderr and no traceback: never a hang, an out-of-memory, or
exit 70 ("a verispec bug").

Every mutant goes through the python API (`verispec.api.load`, then a 2-token generate, as the
CLI does) inside one worker subprocess under RLIMIT_AS and a timeout; a handful, one of each
kind, also go through the `verispec` command itself for the exit status and the one line.
"""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from verispec.testing.fixture_writer import byte_level_vocab

#: address space per subprocess: a tiny model generates in well under this; a size read from a
#: hostile header and allocated would not.
MEMORY_LIMIT_BYTES = 4 << 30
WORKER_TIMEOUT_S, CLI_TIMEOUT_S = 300, 60

#: integer `{arch}.*` keys that size something (a tensor, a cache, a loop over layers or heads):
#: huge values must be refused. context_length is not among them (positions are allocated as
#: they are written, so a long context is no damage).
SIZE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.key_length_swa", "attention.value_length_swa", "attention.sliding_window",
             "rope.dimension_count", "ssm.inner_size", "ssm.state_size", "ssm.conv_kernel",
             "ssm.time_step_rank", "ssm.group_count", "embedding_length_per_layer_input")
#: sizes a model divides by or needs at least one of: zero must be refused.
NONZERO_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.key_length",
                "ssm.inner_size", "ssm.state_size", "ssm.conv_kernel", "ssm.time_step_rank", "ssm.group_count")
#: float keys and the values no model can compute with.
FLOAT_KEYS = {"rope.freq_base": (float("nan"), 0.0, -1.0), "rope.freq_base_swa": (float("nan"),),
              "attention.layer_norm_rms_epsilon": (float("nan"), -1.0),
              "attention.layer_norm_epsilon": (float("nan"), float("inf")),
              "final_logit_softcapping": (float("nan"),)}
HUGE = (10**9, 2**32 - 1)

WORKER = r"""
import json, sys, traceback
import torch
torch.set_num_threads(1)
from verispec.api import load
from verispec.errors import VerispecError
from verispec.registry import Registry

registry = Registry.discover()
for mutant in json.load(open(sys.argv[1])):
    print(json.dumps({"name": mutant["name"], "started": True}), flush=True)
    try:
        engine = load(mutant["path"], registry=registry, threads=1, kv_cache_gb=0)
        "".join(event.text for event in engine.generate("hello", max_tokens=2))
        outcome = {"outcome": "served"}
    except VerispecError as e:
        outcome = {"outcome": "refused", "type": type(e).__name__, "message": str(e)}
    except BaseException as e:
        outcome = {"outcome": "bug", "type": type(e).__name__, "message": traceback.format_exc()}
    print(json.dumps({"name": mutant["name"], **outcome}), flush=True)
"""


def _limits():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def _run(args, timeout):
    # one malloc arena per thread kind: glibc's default (8 per core) reserves address space that a
    # many-core host would count against the limit
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "VERISPEC_DEBUG": "", "MALLOC_ARENA_MAX": "2"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limits, env=env)


def _records(stdout: str) -> list[dict]:
    """The worker's JSON lines (anything else a library printed is skipped)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _section_boundaries(path) -> list[int]:
    """Byte offsets where a GGUF section or entry starts: the header fields, every metadata
    entry and tensor record, the data start, every tensor's data; and the last byte."""
    reader = gguf.GGUFReader(path)
    cuts = {0, 4, 8, 16, 24, os.path.getsize(path) - 1}
    cuts |= {field.offset for field in reader.fields.values()}
    cuts |= {tensor.field.offset for tensor in reader.tensors}
    cuts |= {int(tensor.data_offset) for tensor in reader.tensors}
    return sorted(cuts)


def _metadata_mutants(trunk):
    """(name, metadata override, text the refusal must hold) for the family's fixture."""
    arch, metadata = trunk.arch, trunk.metadata
    for key in SIZE_KEYS:
        value = metadata.get(f"{arch}.{key}")
        for huge in HUGE if value is not None else ():
            bad = np.full(len(value), huge, dtype=np.uint32) if isinstance(value, (list, np.ndarray)) else huge
            yield f"{key}={huge}", {f"{arch}.{key}": bad}, key
    for key in NONZERO_KEYS:
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            bad = np.zeros(len(value), dtype=np.uint32) if isinstance(value, (list, np.ndarray)) else 0
            yield f"{key}=0", {f"{arch}.{key}": bad}, key
    for key, values in FLOAT_KEYS.items():
        for bad in values if f"{arch}.{key}" in metadata else ():
            yield f"{key}={bad}", {f"{arch}.{key}": bad}, key
    num_layers = metadata[f"{arch}.block_count"]
    for key, value in metadata.items():  # a per-layer list one short (M-RoPE's 4 sections are no such list)
        if (key.startswith(f"{arch}.") and isinstance(value, (list, np.ndarray)) and len(value) == num_layers
                and not key.endswith("rope.dimension_sections")):
            yield f"{key.removeprefix(arch + '.')} short", {key: value[:-1]}, key.removeprefix(arch + ".")
    if f"{arch}.attention.sliding_window" in metadata:  # a negative window; Gemma 4's sliding layers need one
        yield "sliding_window=-1", {f"{arch}.attention.sliding_window": _i32(-1)}, "sliding_window"
        if arch == "gemma4":
            yield "sliding_window=0", {f"{arch}.attention.sliding_window": 0}, "sliding_window"
    if f"{arch}.attention.shared_kv_layers" in metadata:  # every layer reads K/V no layer computes
        yield "shared_kv_layers=all", {f"{arch}.attention.shared_kv_layers": num_layers}, "shared_kv_layers"
    rows = trunk.tensors["token_embd.weight"].shape[0]
    tokens = metadata.get("tokenizer.ggml.tokens") or byte_level_vocab(rows)["tokenizer.ggml.tokens"]
    yield "short token list", {"tokenizer.ggml.tokens": tokens[:-7]}, "token list"
    yield "eos outside", {"tokenizer.ggml.eos_token_id": rows}, "eos_token_id"
    yield "bos outside", {"tokenizer.ggml.bos_token_id": rows + 10**6}, "bos_token_id"


def _weight_mutants(trunk):
    """(name, tensor override, the tensor the refusal must name): a NaN norm, an infinite linear."""
    norm = trunk.tensors["output_norm.weight"].clone()
    norm[3] = float("nan")
    yield "NaN norm", {"output_norm.weight": norm}, "output_norm.weight"
    name = next(n for n in trunk.tensors
                if (n.startswith("blk.0.") and n.endswith("_output.weight")) or n == "blk.0.ssm_out.weight")
    linear = trunk.tensors[name].clone()
    linear[0, :] = float("inf")
    yield "inf linear", {name: linear}, name


def _family_mutants(trunk, family, directory: Path) -> dict:
    """The mutants of one family's fixture, written under `directory` (see `family_mutants`)."""
    out = {}
    base = trunk.write(directory / f"{family}.gguf")
    data = Path(base).read_bytes()
    for cut in _section_boundaries(base):
        path = directory / f"{family}-cut{cut}.gguf"
        path.write_bytes(data[:cut])
        out[f"{family} cut at {cut}"] = {"path": str(path), "expect": ("truncated", "not a GGUF file"),
                                         "kind": "cut"}
    for i, (name, metadata, expect) in enumerate(_metadata_mutants(trunk)):
        path = trunk.write(directory / f"{family}-m{i}.gguf", metadata=metadata)
        out[f"{family} {name}"] = {"path": path, "expect": (expect,), "kind": name.split("=")[0]}
    for i, (name, tensors, expect) in enumerate(_weight_mutants(trunk)):
        path = trunk.write(directory / f"{family}-w{i}.gguf", tensors=tensors)
        out[f"{family} {name}"] = {"path": path, "expect": (expect,), "kind": name}
    return out


@pytest.fixture(scope="module")
def family_mutants(tiny_trunks, trunk_families, tmp_path_factory):
    """name -> {"path", "expect" (texts, one of which the refusal holds), "kind"}, every family."""
    out = {}
    directory = tmp_path_factory.mktemp("hostile")
    for family in trunk_families:
        try:
            trunk = tiny_trunks(family)
        except pytest.skip.Exception:
            continue
        out |= _family_mutants(trunk, family, directory)
    if not out:
        pytest.skip("no trunk family is installed")
    return out


def test_every_mutant_is_refused_through_the_api(family_mutants, tmp_path):
    manifest = tmp_path / "mutants.json"
    manifest.write_text(json.dumps([{"name": name, "path": m["path"]} for name, m in family_mutants.items()]))
    try:
        run = _run(["-c", WORKER, str(manifest)], WORKER_TIMEOUT_S)
        records = _records(run.stdout)
    except subprocess.TimeoutExpired as e:
        records = _records(e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        pytest.fail(f"the worker ran past {WORKER_TIMEOUT_S} s, at {records[-1]['name'] if records else 'start'}")
    results = {r["name"]: r for r in records if "outcome" in r}
    started = [r["name"] for r in records if "started" in r]
    assert run.returncode == 0, (f"the worker died (rc {run.returncode}: out of memory under RLIMIT_AS?) at "
                                 f"{started[-1] if started else 'start'}: {run.stderr[-2000:]}")
    problems = []
    for name, mutant in family_mutants.items():
        result = results[name]
        if result["outcome"] != "refused":
            problems.append(f"{name}: {result['outcome']} {result.get('type', '')} {result.get('message', '')}")
        elif "\n" in result["message"] or not any(text in result["message"] for text in mutant["expect"]):
            problems.append(f"{name}: refused with {result['type']} but not naming {mutant['expect']}: "
                            f"{result['message']}")
    assert not problems, f"{len(problems)} of {len(family_mutants)} mutants:\n" + "\n".join(problems)


#: one mutant of each kind through the command, spread over the families.
CLI_CASES = [("llama", "cut"), ("nemotron_h", "block_count"), ("qwen35", "attention.head_count"),
             ("gemma3", "short token list"), ("gemma4", "NaN norm"), ("llama", "eos outside"),
             ("qwen35", "inf linear")]


@pytest.mark.parametrize("family, kind", CLI_CASES)
def test_the_command_refuses_in_one_line_with_exit_1(family_mutants, family, kind):
    candidates = [(name, m) for name, m in family_mutants.items() if name.startswith(f"{family} ")
                  and m["kind"] == kind]
    if not candidates:
        pytest.skip(f"no {kind} mutant for {family} (family not installed)")
    name, mutant = candidates[len(candidates) // 2]
    run = _run(["-m", "verispec.cli", "generate", "hello", "--model", mutant["path"], "--max-tokens", "2",
                "--threads", "1"],
               CLI_TIMEOUT_S)
    assert run.returncode == 1, f"{name}: exit {run.returncode}\n{run.stderr[-3000:]}"
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("verispec: error: "), f"{name}: {run.stderr}"
    assert any(text in lines[0] for text in mutant["expect"]), f"{name}: {lines[0]}"



# --- targeted mutants of the GLM families and the drafters with weights ------------
# A handful per family, aimed at the numbers their configs read beyond the generic SIZE_KEYS (MLA
# ranks, the sparse indexer, expert groups, KDA, hyper-connections, per-layer clamps), the byte-level
# tokenizer's merges, and a drafter's block_count, which sizes per-layer lists (DFlash's tuple, the
# Gemma 4 assistant's layer types). The assistant is loaded onto its trunk, so its sizes, float keys
# and weights (NaN, inf) are refused as --draft-model would refuse them. Each must be refused naming
# its key or tensor, in bounded memory and time (the same worker rules).

TARGETED_WORKER = r"""
import json, sys, traceback
import torch
torch.set_num_threads(1)
from verispec.api import load
from verispec.errors import VerispecError
from verispec.registry import Registry

registry = Registry.discover()
for mutant in json.load(open(sys.argv[1])):
    print(json.dumps({"name": mutant["name"], "started": True}), flush=True)
    try:
        if mutant["loader"] == "dflash":
            from verispec_dflash.loader import read_config
            read_config(mutant["path"])
        elif mutant["loader"] == "gemma4-assistant":
            from verispec_gemma4.loader import load as load_trunk
            from verispec_gemma4_assistant.loader import load as load_assistant
            trunk = load_trunk(mutant["trunk"], dtype="float32", use_cache=False, tokenizer=False)
            load_assistant(mutant["path"], trunk, use_cache=False)
        else:
            engine = load(mutant["path"], registry=registry, threads=1, kv_cache_gb=0)
            "".join(event.text for event in engine.generate("hello", max_tokens=2))
        outcome = {"outcome": "served"}
    except VerispecError as e:
        outcome = {"outcome": "refused", "type": type(e).__name__, "message": str(e)}
    except BaseException as e:
        outcome = {"outcome": "bug", "type": type(e).__name__, "message": traceback.format_exc()}
    print(json.dumps({"name": mutant["name"], **outcome}), flush=True)
"""


def _u64(value):
    from gguf.constants import GGUFValueType
    from gguf.gguf_writer import GGUFValue

    return GGUFValue(value, GGUFValueType.UINT64)


def _i32(value):
    from gguf.constants import GGUFValueType
    from gguf.gguf_writer import GGUFValue

    return GGUFValue(value, GGUFValueType.INT32)


def _vocab_without_merges(rows):
    vocab = byte_level_vocab(rows)
    del vocab["tokenizer.ggml.merges"]
    return vocab


def _vocab_with_a_stray_merge(rows):
    vocab = byte_level_vocab(rows)
    vocab["tokenizer.ggml.merges"] = [*vocab["tokenizer.ggml.merges"], "zz\u00a7q zz\u00a7r"]  # tokens it lacks
    return vocab


#: family -> (builder of (arch, metadata, tensors), [(name, metadata override, vocab maker or None, expected)]).
def _glm4moe():
    from tiny_glm4moe import build_hf_model, hf_to_gguf

    return hf_to_gguf(build_hf_model("grouped")[0])


def _glm_dsa():
    from tiny_glm_dsa import build_hf_model, hf_to_gguf

    return hf_to_gguf(build_hf_model("shared")[0])


def _glm5next():
    from tiny_glm5next import build_hf_model, hf_to_gguf

    return hf_to_gguf(build_hf_model("flash"))


TARGETED = {
    "glm4moe": ("verispec_glm5", _glm4moe, [
        ("expert_group_count=3", {"expert_group_count": 3}, None, "expert_group_count"),
        ("expert_group_used_count=9", {"expert_group_used_count": 9}, None, "expert_group_used_count"),
        ("expert_count=0", {"expert_count": 0}, None, "expert_count"),
        ("expert_weights_scale=nan", {"expert_weights_scale": float("nan")}, None, "expert_weights_scale"),
        ("head_count=-1", {"attention.head_count": _i32(-1)}, None, "head_count"),
        ("block_count=1e9", {"block_count": 10**9}, None, "block_count"),
        ("no merges", {}, _vocab_without_merges, "tokenizer.ggml.merges"),
    ]),
    "glm-dsa": ("verispec_glm5", _glm_dsa, [
        ("q_lora_rank=1e9", {"attention.q_lora_rank": 10**9}, None, "q_lora_rank"),
        ("kv_lora_rank=1e9", {"attention.kv_lora_rank": 10**9}, None, "kv_lora_rank"),
        ("indexer.key_length=1e9", {"attention.indexer.key_length": 10**9}, None, "indexer.key_length"),
        ("key_length_mla=0", {"attention.key_length_mla": 0}, None, "key_length_mla"),
        ("indexer.top_k=0", {"attention.indexer.top_k": 0}, None, "top_k"),
        ("indexer.top_k=-1", {"attention.indexer.top_k": _i32(-1)}, None, "top_k"),
        ("kv_lora_rank=2^63+5", {"attention.kv_lora_rank": _u64(2**63 + 5)}, None, "kv_lora_rank"),
        ("a merge of absent tokens", {}, _vocab_with_a_stray_merge, "tokenizer.ggml"),
    ]),
    "glm5-next": ("verispec_glm5", _glm5next, [
        ("sinkhorn_iterations=1e9", {"hyper_connection.sinkhorn_iterations": 10**9}, None, "sinkhorn_iterations"),
        ("gate_lower_bound=nan", {"kda.gate_lower_bound": float("nan")}, None, "gate_lower_bound"),
        ("swiglu_clamp_exp short", "short:swiglu_clamp_exp", None, "swiglu_clamp_exp"),
        ("swiglu_clamp_shexp inf", "inf:swiglu_clamp_shexp", None, "swiglu_clamp_shexp"),
    ]),
}
DFLASH = [("block_count=1e9", {"block_count": 10**9}, "block_count"),
          ("embedding_length=1e9", {"embedding_length": 10**9}, "embedding_length"),
          ("rms epsilon nan", {"attention.layer_norm_rms_epsilon": float("nan")}, "epsilon")]
#: a Gemma 4 assistant drafter (loaded onto its tiny trunk): (name, `gemma4-assistant.*` overrides
#: (None: the key left out), {tensor: value planted at its first element}, expected in the message).
#: Without a layer pattern the config builds its per-layer lists from block_count alone.
ASSISTANT = [("block_count=1e9", {"block_count": 10**9}, {}, "block_count"),
             ("block_count=1e9, no pattern", {"block_count": 10**9, "attention.sliding_window_pattern": None}, {},
              "block_count"),
             ("block_count=0", {"block_count": 0}, {}, "block_count"),
             ("head_count=0", {"attention.head_count": 0}, {}, "head_count"),
             ("head_count=-1", {"attention.head_count": _i32(-1)}, {}, "head_count"),
             ("head_count=1e9", {"attention.head_count": 10**9}, {}, "head_count"),
             ("head_count_kv=0", {"attention.head_count_kv": 0}, {}, "over 0 KV heads"),
             ("key_length=-1", {"attention.key_length": _i32(-1)}, {}, "key_length"),
             ("key_length=1e9", {"attention.key_length": 10**9}, {}, "key_length"),
             ("key_length_swa=2^32-1", {"attention.key_length_swa": 2**32 - 1}, {}, "key_length_swa"),
             ("embedding_length=1e9", {"embedding_length": 10**9}, {}, "embedding_length"),
             ("embedding_length_out=1e9", {"embedding_length_out": 10**9}, {}, "embedding_length_out"),
             ("feed_forward_length=1e9", {"feed_forward_length": 10**9}, {}, "feed_forward_length"),
             ("sliding_window=1e9", {"attention.sliding_window": 10**9}, {}, "sliding_window"),
             ("sliding_window=-1", {"attention.sliding_window": _i32(-1)}, {}, "sliding_window"),
             ("sliding_window=0", {"attention.sliding_window": 0}, {}, "sliding_window"),
             ("centroid_top_k=1e9", {"centroid_top_k": 10**9}, {}, "top-k"),
             ("rope.freq_base=nan", {"rope.freq_base": float("nan")}, {}, "rope.freq_base"),
             ("rope.freq_base_swa=0", {"rope.freq_base_swa": 0.0}, {}, "rope.freq_base_swa"),
             ("rms epsilon inf", {"attention.layer_norm_rms_epsilon": float("inf")}, {}, "epsilon"),
             ("NaN weight", {}, {"blk.0.attn_q.weight": float("nan")}, "blk.0.attn_q.weight"),
             ("inf rope_freqs", {}, {"rope_freqs.weight": float("inf")}, "rope_freqs.weight")]


def _override(arch, metadata, change):
    """The `{arch}.*` keys of `change` (a dict of suffixes, or "short:KEY" / "inf:KEY" for a per-layer list)."""
    if isinstance(change, str):
        how, key = change.split(":")
        values = list(metadata[f"{arch}.{key}"])
        return {f"{arch}.{key}": values[:-2] if how == "short" else [float("inf")] + values[1:]}
    return {f"{arch}.{k}": v for k, v in change.items()}


@pytest.fixture(scope="module")
def targeted_mutants(tmp_path_factory):
    """name -> {"path", "expect", "loader"[, "trunk"]} for the installed families of TARGETED, DFlash
    and the Gemma 4 assistant."""
    import importlib.util

    from verispec.testing.fixture_writer import write_gguf

    directory, out = tmp_path_factory.mktemp("targeted"), {}
    pytest.importorskip("transformers")
    for family, (package, build, mutants) in TARGETED.items():
        if importlib.util.find_spec(package) is None:
            continue
        arch, metadata, tensors = build()
        rows = int(tensors["token_embd.weight"].shape[0])
        for i, (name, change, vocab, expect) in enumerate(mutants):
            path = write_gguf(directory / f"{family}-{i}.gguf", arch=arch,
                              metadata={**metadata, **_override(arch, metadata, change)}, tensors=tensors,
                              vocab=vocab(rows) if vocab else "byte-level")
            out[f"{family} {name}"] = {"path": path, "expect": expect, "loader": "trunk"}
    if importlib.util.find_spec("verispec_dflash") is not None and importlib.util.find_spec("dflash") is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" / "dflash" / "tests"))
        try:
            from tiny_dflash import make_drafter
            from verispec_dflash.gguf_writer import write_dflash_gguf
        finally:
            sys.path.pop(0)
        drafter = make_drafter("d1_causal_window")
        for i, (name, change, expect) in enumerate(DFLASH):
            path = write_dflash_gguf(directory / f"dflash-{i}.gguf", drafter, vocab=None,
                                     extra_metadata={f"dflash.{k}": v for k, v in change.items()})
            out[f"dflash {name}"] = {"path": path, "expect": expect, "loader": "dflash"}
    if importlib.util.find_spec("verispec_gemma4_assistant") is not None:
        out |= _assistant_mutants(directory)
    if not out:
        pytest.skip("none of verispec-glm5, verispec-dflash, verispec-gemma4-assistant is installed")
    return out


def _assistant_mutants(directory: Path) -> dict:
    """The ASSISTANT mutants of the tiny E-style pair (centroid head, rope_freqs), each with its trunk."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" / "gemma4_assistant" / "tests"))
    try:
        from tiny_assistant import ARCH, assistant_gguf_metadata, assistant_gguf_tensors, make_pair
    finally:
        sys.path.pop(0)
    from verispec.testing.fixture_writer import write_gguf

    target, assistant, trunk, _ = make_pair("e_style", directory)
    metadata, tensors = assistant_gguf_metadata(assistant), assistant_gguf_tensors(assistant, target, rope_freqs=True)
    out = {}
    for i, (name, change, planted, expect) in enumerate(ASSISTANT):
        changed = {**metadata, **{f"{ARCH}.{k}": v for k, v in change.items()}}
        bad = {tensor: tensors[tensor].clone() for tensor in planted}
        for tensor, value in planted.items():
            bad[tensor].view(-1)[0] = value
        path = write_gguf(directory / f"assistant-{i}.gguf", arch=ARCH, tensors={**tensors, **bad}, vocab=None,
                          metadata={k: v for k, v in changed.items() if v is not None})
        out[f"gemma4-assistant {name}"] = {"path": path, "expect": expect, "loader": "gemma4-assistant",
                                           "trunk": trunk}
    return out


def test_targeted_mutants_are_refused_naming_their_key(targeted_mutants, tmp_path):
    manifest = tmp_path / "targeted.json"
    manifest.write_text(json.dumps([{"name": n, "path": m["path"], "loader": m["loader"], "trunk": m.get("trunk")}
                                    for n, m in targeted_mutants.items()]))
    try:
        run = _run(["-c", TARGETED_WORKER, str(manifest)], WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        records = _records(e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        pytest.fail(f"the worker ran past {WORKER_TIMEOUT_S} s, at {records[-1]['name'] if records else 'start'}")
    records = _records(run.stdout)
    started = [r["name"] for r in records if "started" in r]
    assert run.returncode == 0, (f"the worker died (rc {run.returncode}: out of memory under RLIMIT_AS?) at "
                                 f"{started[-1] if started else 'start'}: {run.stderr[-2000:]}")
    results = {r["name"]: r for r in records if "outcome" in r}
    problems = [f"{name}: {results[name]['outcome']} {results[name].get('type', '')} "
                f"{results[name].get('message', '')}" for name, mutant in targeted_mutants.items()
                if results[name]["outcome"] != "refused" or "\n" in results[name]["message"]
                or mutant["expect"] not in results[name]["message"]]
    assert not problems, f"{len(problems)} of {len(targeted_mutants)} mutants:\n" + "\n".join(problems)
