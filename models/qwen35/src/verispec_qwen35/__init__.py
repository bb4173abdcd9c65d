"""verispec trunks for Qwen 3.5 / 3.6 (dense `qwen35`, MoE `qwen35moe`) and their MTP draft head.

- `hooks`: the entry point (TrunkSpec "qwen35"); no torch.
- `modeling_qwen35`: the math (`Qwen35Config`, `Qwen35ForCausalLM`); never opens a file.
- `draft_head`: the built-in MTP block as a PER_TOKEN `DraftHead` bound to the trunk.
- `loader`: GGUF -> config -> module, tokenizer, converted-weight cache.
"""
