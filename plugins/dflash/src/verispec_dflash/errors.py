"""The errors a DFlash file can raise, each a `VerispecError` whose message names the problem and the fix.

Binding problems (a drafter made for another trunk) are `seams.DrafterMismatch`, raised by `loader`.
"""
from __future__ import annotations

from verispec.errors import UnsupportedVariant


class NotADFlashDrafter(UnsupportedVariant):
    """A `dflash` GGUF of another schema (DSpark's Markov/confidence heads, a fork's backbone keys):
    the mainline DFlash/DFlash2 math does not cover it."""

    def __init__(self, source: str, what: str):
        super().__init__(source, f"not a DFlash drafter: {what}",
                         "this package runs the llama.cpp mainline DFlash/DFlash2 schema only")


class UnsupportedDFlash(UnsupportedVariant):
    """A DFlash file using a feature this package does not implement yet (biases, YaRN, a reduced
    draft vocabulary, ...): refused by name rather than run wrongly."""


class MalformedDFlash(UnsupportedVariant):
    """A DFlash file whose keys and tensors contradict each other (partial DFlash2, a pattern of the
    wrong length, shapes that do not fit the sizes)."""

    def __init__(self, source: str, what: str):
        super().__init__(source, what, "re-convert the drafter with llama.cpp's convert_hf_to_gguf.py "
                                       "(--target-model-dir the target)")
