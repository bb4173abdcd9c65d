"""--device and verispec.load(device=): resolution, the refusal of CUDA where torch sees none
(one line naming the fix, exit 1), and the trunks' gate."""
import os
import subprocess
import sys

import pytest
import torch

import verispec
from verispec.device import require_trunk_device, resolve_device
from verispec.errors import InvalidArgument, VerispecError

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_cpu_default_and_auto_follows_torch(monkeypatch):
    assert resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(InvalidArgument, match="device 'tpu': choose one of cpu, cuda, auto"):
        resolve_device("tpu")


@needs_no_cuda
def test_cuda_without_cuda_names_the_problem_and_the_fix():
    with pytest.raises(InvalidArgument, match=r"--device cuda: torch .* sees no CUDA device; .* or use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(InvalidArgument, match="sees no CUDA device"):
        verispec.load(device="cuda")  # before any model is read


def test_the_trunks_run_on_the_cpu():
    require_trunk_device(torch.device("cpu"))
    with pytest.raises(VerispecError, match="the trunks do not run on cuda yet.*use --device cpu"):
        require_trunk_device(torch.device("cuda"))


@needs_no_cuda
def test_cli_device_cuda_without_cuda_is_one_line_and_exit_1():
    code = "import sys; from verispec.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--device", "cuda"], env=os.environ,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "sees no CUDA device" in r.stderr and "--device cpu" in r.stderr


def test_a_family_that_declares_cuda_runs_there_and_the_others_are_named():
    from verispec.nn.trunk_module import TrunkModule

    class OnCuda(TrunkModule):
        devices = ("cpu", "cuda")

    class CpuOnly(TrunkModule):
        pass

    require_trunk_device(torch.device("cuda"), OnCuda)
    require_trunk_device(torch.device("cpu"), CpuOnly)
    with pytest.raises(VerispecError, match=r"the CpuOnly trunk does not run on cuda yet .* use --device cpu"):
        require_trunk_device(torch.device("cuda"), CpuOnly)


def test_packed_integer_dtypes_are_refused_off_the_cpu():
    from verispec.nn.trunk_module import TrunkModule

    class OnCuda(TrunkModule):
        devices = ("cpu", "cuda")

    trunk = OnCuda()
    for dtype in ("int8", "int4"):
        trunk.dtype = dtype
        with pytest.raises(VerispecError, match=f"--dtype {dtype} on cuda: .*use --dtype gguf"):
            trunk.to_device("cuda")


def test_on_a_gpu_only_block_linears_declare_batch_invariance():
    """cuBLAS picks its blocking by shape: a placed trunk with a float linear declares no batch
    invariance, one whose linears are all GGUF block linears (Triton) does."""
    from gguf.constants import GGMLQuantizationType as T
    from verispec.nn.trunk_module import TrunkModule
    from verispec.weights.block_linear import block_linear_class
    from verispec.weights.quant import Float32Linear

    trunk = TrunkModule()
    trunk.max_rows_per_forward = 64
    trunk.head = block_linear_class(T.Q4_0)(32, 16, device="meta")
    trunk.trunk_device = torch.device("cuda")
    assert trunk.spec_batch_invariant
    trunk.other = Float32Linear(32, 16, device="meta")
    assert not trunk.spec_batch_invariant


def test_off_the_cpu_int8_is_refused_before_the_model_loads(monkeypatch):
    from verispec import api
    from verispec.errors import InvalidArgument

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    with pytest.raises(InvalidArgument, match="--dtype int8 on cuda: .*use --dtype gguf"):
        api.load("/nonexistent/model.gguf", dtype="int8", device="cuda")  # no file is opened first
