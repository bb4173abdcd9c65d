"""Entry point of verispec-qwen35: the Qwen 3.5 / 3.6 hybrid trunk (no torch here)."""
from verispec.hookspecs import hookimpl
from verispec.specs import TargetSpec


@hookimpl
def register_targets(register):
    register(TargetSpec(
        name="qwen35",
        summary="Qwen 3.5 / 3.6 dense and MoE trunks (GatedDeltaNet + gated attention; MTP draft head)",
        architectures=("qwen35", "qwen35moe"),
        loader="verispec_qwen35.loader:load",
    ))
