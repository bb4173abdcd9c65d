"""Entry point of verispec-qwen35: the Qwen 3.5 / 3.6 hybrid trunk (no torch here)."""
from verispec.hookspecs import hookimpl
from verispec.specs import DraftFileSpec, TrunkSpec

ARCHITECTURES = ("qwen35", "qwen35moe")


@hookimpl
def register_trunks(register):
    register(TrunkSpec(
        name="qwen35",
        summary="Qwen 3.5 / 3.6 dense and MoE trunks (GatedDeltaNet + gated attention; MTP draft head)",
        architectures=ARCHITECTURES,
        loader="verispec_qwen35.loader:load",
    ))


@hookimpl
def register_draft_files(register):
    register(DraftFileSpec(
        name="qwen35-mtp",
        summary="a standalone Qwen 3.5 / 3.6 MTP GGUF (the converter's --mtp output), paired with its main file",
        architectures=ARCHITECTURES,
        loader="verispec_qwen35.loader:load_mtp_file",
        trunks=ARCHITECTURES,
    ))
