"""Cross-check against llama.cpp itself: its own loader and graph run our tiny glm4moe fixtures
(llama.cpp's tensor names, keys and layouts, as `tiny_glm4moe.hf_to_gguf` writes them) and its
`llama-perplexity` must give the perplexity our trunk gives on the same text (fp32 weights,
fp32 KV cache; llama-perplexity's scoring: `verispec.testing.perplexity`).

Runs only where llama.cpp is built (`python benchmarks/llama_cpp.py --build`, ~10-20 min once;
CI does not build it, so there it skips). The NextN block is in the `nextn` file (llama.cpp
loads it by its NEXTN names; perplexity does not run it). Measured against llama.cpp b11434:
nextn 580.7089 (llama.cpp) vs 580.7090 (ours), grouped 1469.7257 vs 1469.7257; the bound is
2e-5 relative.

glm-dsa (`tiny_glm_dsa`, 64-token windows past index_topk, so llama.cpp's sparse selection runs
too): shared 1002.7481 vs 1002.7482, full 1441.7598 vs 1441.7597. Those files set the rms epsilon
to 1e-6: llama.cpp's graph uses the file's epsilon for the q_a / kv_a latent norms, where
transformers (and this package) use 1e-6 whatever the config says.

glm5-next (`tiny_glm5next` "flash": KDA and NoPE MLA layers, the k-pool indexer selecting 4 of 16
pools in each 64-token window, mHC, the NextN block in the file): 1035.8216 vs 1035.8214
(2e-7 relative), with the fixture's own epsilons (rms 1e-5, indexer k-norm 1e-6) unchanged.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
llama_cpp = pytest.importorskip("llama_cpp", reason="benchmarks/llama_cpp.py not found")  # our script, not the pip package
from tiny_glm4moe import build_hf_model, write_fixture  # noqa: E402
from verispec.testing import llama_cpp_perplexity, our_perplexity  # noqa: E402
from verispec_glm5.loader import load  # noqa: E402
from verispec_glm5.loader_glm_dsa import load as load_glm_dsa  # noqa: E402
from verispec_glm5.loader_glm5next import load as load_glm5next  # noqa: E402



@pytest.mark.parametrize("name", ["nextn", "grouped"])
def test_llama_cpp_perplexity_equals_ours(name, tmp_path):
    binary = llama_cpp.built("llama-perplexity") or pytest.skip(
        "llama.cpp's llama-perplexity is not built: python benchmarks/llama_cpp.py --build")
    hf_model, mtp = build_hf_model(name)
    # "default": this llama.cpp refuses the "gpt2" pre-tokenizer name
    path = write_fixture(hf_model, tmp_path / "model.gguf", mtp=mtp, extra_metadata={"tokenizer.ggml.pre": "default"})
    theirs = llama_cpp_perplexity(binary, path, tmp_path)
    ours = our_perplexity(load(path, dtype="float32", use_cache=False))
    assert abs(ours - theirs) <= 2e-5 * theirs


@pytest.mark.parametrize("name", ["shared", "full"])
def test_llama_cpp_perplexity_equals_ours_glm_dsa(name, tmp_path):
    import tiny_glm_dsa

    binary = llama_cpp.built("llama-perplexity") or pytest.skip(
        "llama.cpp's llama-perplexity is not built: python benchmarks/llama_cpp.py --build")
    hf_model, mtp = tiny_glm_dsa.build_hf_model(name)
    path = tiny_glm_dsa.write_fixture(hf_model, tmp_path / "model.gguf", mtp=mtp, extra_metadata={
        "tokenizer.ggml.pre": "default", "glm-dsa.attention.layer_norm_rms_epsilon": 1e-6})
    theirs = llama_cpp_perplexity(binary, path, tmp_path)
    ours = our_perplexity(load_glm_dsa(path, dtype="float32", use_cache=False))
    assert abs(ours - theirs) <= 2e-5 * theirs


def test_llama_cpp_perplexity_equals_ours_glm5next(tmp_path):
    import tiny_glm5next

    binary = llama_cpp.built("llama-perplexity") or pytest.skip(
        "llama.cpp's llama-perplexity is not built: python benchmarks/llama_cpp.py --build")
    hf_model = tiny_glm5next.build_hf_model("flash")
    path = tiny_glm5next.write_fixture(hf_model, tmp_path / "model.gguf",
                                       extra_metadata={"tokenizer.ggml.pre": "default"})
    theirs = llama_cpp_perplexity(binary, path, tmp_path)
    ours = our_perplexity(load_glm5next(path, dtype="float32", use_cache=False))
    assert abs(ours - theirs) <= 2e-5 * theirs
