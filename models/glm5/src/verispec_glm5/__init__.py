"""verispec trunks for the GLM family; this slice: GLM-4.5 / 4.6 / 4.7 (`glm4moe`) and its NextN head.

- `hooks`: the entry point (TrunkSpec "glm4moe"); no torch.
- `modeling_glm4moe`: the math (`Glm4MoeConfig`, `Glm4MoeForCausalLM`); never opens a file.
- `draft_head`: the built-in NextN block as a PER_TOKEN `DraftHead` bound to the trunk.
- `loader`: GGUF -> config -> module, tokenizer, converted-weight cache.
"""
