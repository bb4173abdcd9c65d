"""Entry point of verispec-glm5: the GLM-4.5 / 4.6 / 4.7 `glm4moe`, GLM-5.x `glm-dsa` and GLM-5.3-Flash
`glm5-next` trunks (no torch here)."""
from verispec.hookspecs import hookimpl
from verispec.specs import TrunkSpec

ARCHITECTURES = ("glm4moe",)


@hookimpl
def register_trunks(register):
    register(TrunkSpec(
        name="glm4moe",
        summary="GLM-4.5 / 4.6 / 4.7 trunks (GQA, partial NeoX RoPE, sigmoid-routed MoE; NextN draft head)",
        architectures=ARCHITECTURES,
        loader="verispec_glm5.loader:load",
    ))
    register(TrunkSpec(
        name="glm-dsa",
        summary="GLM-5 / 5.1 / 5.2 trunks (MLA with the DSA top-k indexer, sigmoid-routed MoE)",
        architectures=("glm-dsa",),
        loader="verispec_glm5.loader_glm_dsa:load",
    ))
    register(TrunkSpec(
        name="glm5-next",
        summary="GLM-5.3-Flash trunks (KDA hybrid, NoPE MLA with the k-pool DSA indexer, mHC, MoE)",
        architectures=("glm5-next", "glm5next"),
        loader="verispec_glm5.loader_glm5next:load",
    ))
