"""Cross-check against llama.cpp itself: its own loader and math run our tiny qwen35 / qwen35moe
fixtures (llama.cpp's tensor names, keys and layouts, as `tiny_qwen35.hf_to_gguf` writes them)
and its `llama-perplexity` must give the perplexity our trunk gives on the same text.

Runs only where llama.cpp is built (`python benchmarks/llama_cpp.py --build`, ~10-20 min once;
CI does not build it, so there it skips). llama.cpp's
qwen35 code takes the GDN value head size from `ssm.state_size` (head_v_dim = head_k_dim), so
these fixtures use dk == dv (the other fixtures keep them distinct to catch a transposed state).
Its KV cache is asked for in fp32 (`-ctk f32 -ctv f32`); the rest of its CPU math on F32
weights is fp32. Measured against llama.cpp b11434: dense 784.1645 (llama.cpp) vs 784.1640
(ours), MoE 1976.7406 vs 1976.7439: within 2e-6 relative; the bound is 2e-5. The MTP block is in both files (llama.cpp
loads it by its NEXTN names; perplexity does not run it).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
llama_cpp = pytest.importorskip("llama_cpp", reason="benchmarks/llama_cpp.py not found")  # our script, not the pip package
from tiny_qwen35 import TINY_CONFIGS, _COMMON, build_hf_model, write_fixture  # noqa: E402
from verispec.testing import llama_cpp_perplexity, our_perplexity  # noqa: E402
from verispec_qwen35.loader import load  # noqa: E402



@pytest.mark.parametrize("name", ["dense_mtp", "moe_fused_mtp"])
def test_llama_cpp_perplexity_equals_ours(name, tmp_path):
    binary = llama_cpp.built("llama-perplexity") or pytest.skip(
        "llama.cpp's llama-perplexity is not built: python benchmarks/llama_cpp.py --build")
    model_type, _, kwargs, options = TINY_CONFIGS[name]
    TINY_CONFIGS[f"{name}_dk_eq_dv"] = (model_type, _, {**kwargs, "linear_value_head_dim": _COMMON["linear_key_head_dim"]},
                                        options)
    hf_model, mtp = build_hf_model(f"{name}_dk_eq_dv")
    path = write_fixture(hf_model, tmp_path / "model.gguf", mtp=mtp, options=options,
                         extra_metadata={"tokenizer.ggml.pre": "default"})  # this llama.cpp refuses "gpt2"
    theirs = llama_cpp_perplexity(binary, path, tmp_path)
    ours = our_perplexity(load(path, dtype="float32", use_cache=False))
    assert abs(ours - theirs) <= 2e-5 * theirs
