"""verispec.cpu.slow_decode_hint: one line when a decode runs far below what its weights cost."""
import torch

from verispec import cpu
from verispec.cpu import SLOW_FACTOR, STEP_ALLOWANCE_MS, slow_decode_hint, weight_bytes


def test_weight_bytes_counts_a_shared_tensor_once():
    module = torch.nn.Module()
    module.a = torch.nn.Linear(4, 8, bias=False)  # 32 fp32 = 128 bytes
    module.b = module.a  # tied
    module.register_buffer("scales", torch.zeros(8, dtype=torch.bfloat16))  # 16 bytes
    assert weight_bytes(module) == 128 + 16


def test_hint_only_when_far_above_the_weight_streaming_cost():
    num_bytes = 100_000_000  # 10 ms at the 10 GB/s floor, plus the per-step allowance
    expected_ms = 10 + STEP_ALLOWANCE_MS
    assert slow_decode_hint(SLOW_FACTOR * expected_ms - 1, num_bytes, threads=2) is None
    assert slow_decode_hint(SLOW_FACTOR * expected_ms + 1, num_bytes, threads=2) is not None
    hint = slow_decode_hint(600.0, num_bytes, threads=2)
    assert hint.startswith("hint: decode took 600 ms/token") and "100 MB" in hint and "--threads 1" in hint
    assert f"the {expected_ms:.0f} ms that" in hint
    assert "--threads 1" not in slow_decode_hint(600.0, num_bytes, threads=1)


def test_a_tiny_model_at_the_fixed_step_cost_gets_no_hint():
    """A model of a few hundred kB decodes at ~1 ms/token on a quiet machine, all of it the
    step's fixed overhead rather than its weights: that is not slow."""
    assert STEP_ALLOWANCE_MS >= 1
    assert slow_decode_hint(1.0, 300_000, threads=1) is None
    assert slow_decode_hint(SLOW_FACTOR * STEP_ALLOWANCE_MS - 0.5, 300_000, threads=2) is None
    assert "the 2 ms that" in slow_decode_hint(50.0, 300_000, threads=2)


def test_api_threads_auto_sets_the_idle_cores(monkeypatch, tmp_path):
    from verispec import api, cpu
    from verispec.registry import Registry
    from verispec.testing import toy_plugin
    from verispec.testing.toy import write_toy_gguf

    path = write_toy_gguf(tmp_path / "toy.gguf", vocab_size=110)
    before = torch.get_num_threads()
    idle = 2 if before == 1 else 1  # differs from the current count, so the assertion can fail
    monkeypatch.setattr(cpu, "default_threads", lambda: idle)
    try:
        api.load_registered_trunk(str(path), Registry.from_plugins({"toy": toy_plugin}), threads="auto")
        assert torch.get_num_threads() == idle
    finally:
        torch.set_num_threads(before)


def test_gguf_weights_without_the_kernels_get_their_own_hint(monkeypatch):
    """A slow decode of gguf weights on the PyTorch path names that cause, not another process."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from verispec.step_stats import ExecutionStats
    from verispec.kernels import ckernels
    from verispec.weights.block_linear import block_linear_class
    from verispec.weights.gguf_blocks import GGUFBlocks

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    raw = np.zeros((16, 64 // block_size * type_size), dtype=np.uint8)
    trunk = torch.nn.Sequential(block_linear_class(GGMLQuantizationType.Q8_0).from_gguf(
        [GGUFBlocks(GGMLQuantizationType.Q8_0, torch.from_numpy(raw), 64)]))
    engine = type("Engine", (), {"trunk": trunk})()
    result = type("Result", (), {"decode_tokens_per_s": 0.5, "tokens": list(range(10)),
                                 "spec": ExecutionStats()})()
    monkeypatch.setattr(cpu, "FLOOR_BYTES_PER_S", 1e30)  # weights that cost nothing: any decode is "slow"
    monkeypatch.setattr(ckernels, "library", lambda: None)
    assert "PyTorch path" in cpu.generation_hint(engine, result)
    monkeypatch.setattr(ckernels, "library", lambda: object())
    assert "another process" in cpu.generation_hint(engine, result)


def test_a_decode_slow_only_for_its_drafting_names_the_speculator(monkeypatch):
    """80 ms/token against a 36 ms hint threshold: with 65 ms of each token in propose the
    plugin is named, with 20 ms the rest is still slow and the machine hint stands."""
    from verispec.step_stats import ExecutionStats

    engine = type("Engine", (), {"trunk": torch.nn.Linear(250, 100, bias=False)})()  # 100 kB of fp32
    monkeypatch.setattr(cpu, "FLOOR_BYTES_PER_S", 1e7)  # 10 ms a token to stream, 12 with the step; 3x: 36

    def hint(draft_ms_per_token):
        result = type("Result", (), {"decode_tokens_per_s": 12.5, "tokens": list(range(64)),
                                     "speculator": "slowpoke",
                                     "spec": ExecutionStats(draft_s=draft_ms_per_token * 63 / 1e3)})()
        return cpu.generation_hint(engine, result)

    named = hint(65.0)
    assert named.startswith("hint: decode took 80 ms/token, 65 ms of it drafting in speculator 'slowpoke'")
    assert "another process" not in named and "--no-spec" in named
    assert "another process" in hint(20.0) and "another process" in hint(0.0)
