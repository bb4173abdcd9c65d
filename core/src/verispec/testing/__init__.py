"""Test kit for verispec and its plugins (also a pytest plugin, entry point `pytest11`).

- `TrunkConformance`, `SpeculatorConformance`: suites to subclass (see `conformance`);
  `HeadSpeculatorConformance` for a drafter reading hidden rows (see `speculator_conformance`).
- `assert_plugin_loads(module)`: a plugin registers and every reference it names imports (see `registration`).
- `NextNHeadSuite` (with `NextNCase`, `NextNTraining`): a NextN / MTP draft head's suite (see `nextn_suite`).
- `ToyTrunk`, `MarkovTrunk`, `ScriptedSpeculator`, `oracle_speculator`: toy trunks and drafters (see `toy`;
  `toy_plugin`: a whole toy plugin, trunk family, BLOCK head from its own drafter file, block speculator).
- `run_greedy`, `run_greedy_requests`: greedy streams through the engine's scheduler;
  `assert_staggered_streams_plain` (a mostly wrong drafter, requests arriving apart) and
  `assert_second_turn_streams_plain` (a drafter over a reused prefix) on them (see `conformance`).
- `make_copy_model`: a transformers model rebuilt to continue one token forever, the trunk of a
  perfect-drafter test (see `copy_model`).
- `fixture_writer`: writes tiny GGUF fixtures with llama.cpp's key and tensor names.
- `our_perplexity`, `llama_cpp_perplexity`: llama-perplexity's score, ours and llama.cpp's, and
  `run_llama_cpp`, any llama.cpp tool's output for a cross-check (see `perplexity`).
- Checks the families' tests share: `device_path` (a trunk placed on a device), `gguf_weights` (the
  `gguf` weight mode against gguf-py), `hf_parity` (fp32 logits against transformers'); helpers:
  `serving` (a server on a loopback port), `terminal` (a command on a pseudo-terminal, Ctrl-C).
- `real_checkpoint`, `built_once` (and the `one_thread` fixture): shared test scaffolding (see `plugin`).

Imports are lazy so that loading the pytest plugin does not import torch.
"""
import importlib

_EXPORTS = {
    "TrunkConformance": "verispec.testing.conformance",
    "SpeculatorConformance": "verispec.testing.speculator_conformance",
    "HeadSpeculatorConformance": "verispec.testing.speculator_conformance",
    "assert_plugin_loads": "verispec.testing.registration",
    "run_greedy": "verispec.testing.conformance",
    "run_greedy_requests": "verispec.testing.conformance",
    "assert_second_turn_streams_plain": "verispec.testing.conformance",
    "assert_staggered_streams_plain": "verispec.testing.conformance",
    "forward_one": "verispec.testing.conformance",
    "plain_logits": "verispec.testing.conformance",
    "teacher_forced_logits": "verispec.testing.conformance",
    "assert_rows_within": "verispec.testing.conformance",
    "NextNHeadSuite": "verispec.testing.nextn_suite",
    "NextNCase": "verispec.testing.nextn_suite",
    "NextNTraining": "verispec.testing.nextn_suite",
    "make_copy_model": "verispec.testing.copy_model",
    "ToyTrunk": "verispec.testing.toy",
    "MarkovTrunk": "verispec.testing.toy",
    "ScriptedSpeculator": "verispec.testing.toy",
    "oracle_speculator": "verispec.testing.toy",
    "real_checkpoint": "verispec.testing.plugin",
    "built_once": "verispec.testing.plugin",
    "our_perplexity": "verispec.testing.perplexity",
    "llama_cpp_perplexity": "verispec.testing.perplexity",
    "run_llama_cpp": "verispec.testing.perplexity",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'verispec.testing' has no attribute {name!r}")
