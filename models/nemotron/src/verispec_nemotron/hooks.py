"""Entry point of verispec-nemotron: the Nemotron-H trunk loader (no torch here)."""
from verispec.hookspecs import hookimpl
from verispec.specs import TrunkSpec


@hookimpl
def register_trunks(register):
    register(TrunkSpec(
        name="nemotron_h",
        summary="Nemotron-H dense and MoE trunks (Mamba-2 with per-row state, attention, relu² MLP / "
                "sigmoid-routed MoE)",
        architectures=("nemotron_h", "nemotron_h_moe"),
        loader="verispec_nemotron.loader:load",
    ))
