"""verispec trunks for the GLM family: GLM-4.5 / 4.6 / 4.7 (`glm4moe`) and GLM-5.x (`glm-dsa`),
each with its NextN head, and GLM-5.3-Flash (`glm5-next`).

- `hooks`: the entry points (TrunkSpecs "glm4moe", "glm-dsa", "glm5-next"); no torch.
- `modeling_glm4moe`, `modeling_glm_dsa`, `modeling_glm5next`: the math (configs, trunks); never open a file.
- `mla`: multi-head latent attention over a paged latent cache and the DSA top-k indexer.
- `draft_head`, `draft_head_glm_dsa`: the built-in NextN blocks as PER_TOKEN `DraftHead`s.
- `loader`, `loader_glm_dsa`, `loader_glm5next`: GGUF -> config -> module, tokenizer, converted-weight cache.
"""
