"""verispec trunks for llama and qwen2 dense GGUFs.

- `hooks`: the entry point (TrunkSpec "llama", two CheckpointSpecs); no torch.
- `modeling_llama`: the math (`LlamaConfig`, `LlamaForCausalLM`); never opens a file.
- `loader`: GGUF -> config -> module, tokenizer, converted-weight cache.
"""
