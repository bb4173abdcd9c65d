"""verispec-dflash: the DFlash and DFlash2 block drafters (`general.architecture = dflash` GGUFs).

Modules, one concept each: `hooks` (registration, no torch), `errors`, `config` (the GGUF
contract: keys, tensors, generation), `binding` (the checks against the trunk), `loader`,
`ring` (the per-sequence context KV), `conv` (DFlash2's grouped dynamic conv), `selector`
(DFlash2's greedy lattice walk), `drafter` (Pass A/B/C), `head` (the BLOCK `DraftHead`),
`speculator` (the `dflash` speculator `--spec-type block` picks), `gguf_writer` (reference state dict -> GGUF).
The spec is the shared reference note on DFlash (its errata first).
"""
