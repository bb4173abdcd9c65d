"""triton_dispatch.use_triton: the Triton kernels on CUDA tensors (here: CPU tensors under the
interpreter with VERISPEC_TRITON=1), switched off by VERISPEC_TRITON=0 or a missing triton package."""
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read as triton is imported
pytest.importorskip("triton", reason="the Triton kernels' tests need triton: pip install 'verispec[test]'")

from verispec.kernels import triton_dispatch  # noqa: E402


def test_cpu_tensors_only_when_asked_under_the_interpreter(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("VERISPEC_TRITON", raising=False)
    assert not triton_dispatch.use_triton(x)  # unset: CUDA tensors only
    monkeypatch.setenv("VERISPEC_TRITON", "0")
    assert not triton_dispatch.use_triton(x)
    monkeypatch.setenv("VERISPEC_TRITON", "1")
    assert triton_dispatch.use_triton(x)


def test_off_without_triton_or_outside_the_interpreter_on_cpu(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("VERISPEC_TRITON", "1")
    monkeypatch.setattr(triton_dispatch, "available", lambda: False)
    assert not triton_dispatch.use_triton(x)
    monkeypatch.setattr(triton_dispatch, "available", lambda: True)
    monkeypatch.setattr(triton_dispatch, "_interpreting", lambda: False)
    assert not triton_dispatch.use_triton(x)  # a CPU tensor without the interpreter: the C / PyTorch path


def test_a_bad_switch_is_one_line_naming_the_values(monkeypatch):
    monkeypatch.setenv("VERISPEC_TRITON", "yes")
    with pytest.raises(ValueError, match=r"VERISPEC_TRITON='yes': set it to 0 .* or 1"):
        triton_dispatch.use_triton(torch.zeros(1))
