"""verispec trunks for the GLM family: GLM-4.5 / 4.6 / 4.7 (`glm4moe`) and GLM-5.x (`glm-dsa`),
each with its NextN head.

- `hooks`: the entry points (TrunkSpecs "glm4moe", "glm-dsa"); no torch.
- `modeling_glm4moe`, `modeling_glm_dsa`: the math (configs, trunks); never open a file.
- `mla`: multi-head latent attention over a paged latent cache and the DSA top-k indexer.
- `draft_head`, `draft_head_glm_dsa`: the built-in NextN blocks as PER_TOKEN `DraftHead`s.
- `loader`, `loader_glm_dsa`: GGUF -> config -> module, tokenizer, converted-weight cache.
"""
