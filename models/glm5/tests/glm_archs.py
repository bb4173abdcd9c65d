"""The glm5 package's three architectures as the tests parametrised over them see them: each one's
loader, test map (`tiny_glm4moe`, `tiny_glm_dsa`, `tiny_glm5next`), the tiny configs its tests run
on and what its `gguf` weight-mode file is made of. The conftest's `tiny_glm` builds the files.

- glm4moe (GLM-4.5 .. 4.7): GQA attention with q/k norms and biases, MoE with a NextN block.
- glm-dsa (GLM-5 / 5.1 / 5.2): MLA over a paged latent cache and the DSA top-k indexer (a shared
  indexer layer in "shared"); its prompts run past index_topk (24 / 17), so keys are a strict subset.
- glm5-next (GLM-5.3-Flash): KDA layers beside NoPE MLA with the k-pool indexer, mHC streams;
  prompts run past index_topk + kpool (16 + 4).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

#: the conformance suites' prompt when a file's indexer must select (longer than index_topk)
LONG_PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26,
               43, 38, 32, 79, 50]

#: GGUF suffix (the name after `blk.{i}.`, or the whole name) -> block type in the `gguf` mode files:
#: attention Q8_0, indexer and dense FFN Q5_0, experts (3-D) Q4_0, shared expert Q4_1
_BLOCK_TYPES = {
    "attn_output.weight": "Q8_0", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q5_0",
    "ffn_gate_exps.weight": "Q4_0", "ffn_up_exps.weight": "Q4_0", "ffn_down_exps.weight": "Q4_0",
    "ffn_gate_shexp.weight": "Q4_1", "ffn_up_shexp.weight": "Q4_1", "ffn_down_shexp.weight": "Q4_1",
    "nextn.eh_proj.weight": "Q8_0", "output.weight": "Q8_0",
}
_MLA_TYPES = {"attn_q_a.weight": "Q8_0", "attn_q_b.weight": "Q8_0", "attn_kv_a_mqa.weight": "Q8_0",
              "indexer.attn_q_b.weight": "Q5_0", "indexer.attn_k.weight": "Q5_0", "indexer.proj.weight": "Q5_0"}
_QKV_TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0"}
#: KDA's gates
_KDA_GATE_TYPES = {name: "Q5_1" for name in ("ssm_f_a.weight", "ssm_f_b.weight", "ssm_beta.weight",
                                             "ssm_g_a.weight", "ssm_g_b.weight")}


@dataclass(frozen=True)
class GgufMode:
    """The `gguf` weight-mode checks' data: block types by suffix, the fewest typed tensors, the types
    the file's tensors must be checked in, the verify check's prefix, and how close the logits stay
    to the fp32 run of the same dequantised weights (median row error and far-row bound as shares
    of the logit scale, the greedy agreement, and whether the int8 mode must be no closer)."""

    types: dict
    min_typed: int
    checked: frozenset
    prompt: list
    verify_prefix: int
    median: float
    far: float
    argmax: float
    beats_int8: bool = False


@dataclass(frozen=True)
class GlmArch:
    name: str  #: the GGUF architecture
    loader: str  #: the module whose `load` reads it
    tiny: str  #: its test map
    nextn: str  #: the TINY_CONFIGS entry the NextN-head and engine tests run on
    conformance: tuple  #: (TINY_CONFIGS entry, dtype) pairs the trunk suite runs on
    prompt: list  #: the trunk suite's prompt
    gguf: GgufMode = field(repr=False)

    def load(self, path, **options):
        return importlib.import_module(self.loader).load(path, **options)

    def module(self):
        return importlib.import_module(self.tiny)

    @property
    def block_in_model(self) -> bool:
        """glm5-next's test model holds its NextN block (`model.mtp`); the others' is separate."""
        return self.name == "glm5-next"

    def build(self, name: str):
        """(the seeded transformers model of TINY_CONFIGS[name], its NextN block or None)."""
        built = self.module().build_hf_model(name)
        return (built, built.mtp) if self.block_in_model else built

    def hf_to_gguf(self, model, mtp):
        """(arch, metadata, tensors) of `model` (+ `mtp`) in llama.cpp's names."""
        return self.module().hf_to_gguf(model) if self.block_in_model else self.module().hf_to_gguf(model, mtp)

    def write(self, model, mtp, path, **changes) -> str:
        """The GGUF of `model` (+ `mtp`) at `path`; `changes`: the test map's write_fixture options."""
        if not self.block_in_model:
            changes["mtp"] = mtp
        return self.module().write_fixture(model, path, **changes)


ARCHS = {a.name: a for a in (
    GlmArch("glm4moe", "verispec_glm5.loader", "tiny_glm4moe", "nextn",
            (("nextn", "float32"), ("nextn", "int8"), ("grouped", "int8")),
            [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3],
            GgufMode({**_QKV_TYPES, **_BLOCK_TYPES}, 20, frozenset({"Q8_0", "Q5_0", "Q4_1"}),
                     [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 40, 77, 101, 3], 24, 0.05, 0.1, 0.8)),
    GlmArch("glm-dsa", "verispec_glm5.loader_glm_dsa", "tiny_glm_dsa", "shared",
            (("shared", "float32"), ("shared", "int8"), ("full", "int8")), LONG_PROMPT,
            GgufMode({**_MLA_TYPES, **_BLOCK_TYPES}, 20, frozenset({"Q8_0", "Q5_0", "Q4_1"}),
                     list(range(7, 39)), 28, 0.05, 0.1, 0.8)),
    # the KDA gates (exp of a projection), the mHC mixes and the swiglu clamp amplify rounding more
    # than glm-dsa's plain residuals, so its bounds are looser and held against the int8 weight-only
    # mode's distance on the same tokens (measured: median row error 0.050 of the logit scale in gguf
    # mode, 0.079 in int8 mode; greedy 85% vs 69% equal)
    GlmArch("glm5-next", "verispec_glm5.loader_glm5next", "tiny_glm5next", "flash",
            (("flash", "float32"), ("flash", "int8")), LONG_PROMPT[:30],
            GgufMode({**_QKV_TYPES, **_KDA_GATE_TYPES, **_MLA_TYPES, **_BLOCK_TYPES}, 40,
                     frozenset({"Q8_0", "Q5_0", "Q5_1", "Q4_1"}), list(range(7, 39)), 28, 0.08, 0.25, 0.75,
                     beats_int8=True)),
)}


def block_types(types: dict, tensors) -> dict:
    """GGUF name -> block type for the tensors whose suffix (after `blk.{i}.`) is in `types`."""
    suffixes = {name: name.split(".", 2)[-1] if name.startswith("blk.") else name for name in tensors}
    return {name: types[suffix] for name, suffix in suffixes.items() if suffix in types}
