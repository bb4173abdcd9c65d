"""verispec-gemma4-assistant: Gemma 4's assistant (MTP drafter), a stateless per-token draft head
that reads its trunk's own KV.

- `hooks`: entry point (the `gemma4-assistant` drafter file and speculator); no torch.
- `config`: the GGUF's numbers (`AssistantConfig`).
- `binding`: whether an assistant fits a trunk (`binding_problem`).
- `modeling`: one draft step's math (`Gemma4Assistant`).
- `head`: the PER_TOKEN `DraftHead` (`Gemma4AssistantHead`).
- `loader`: the `DraftFileSpec` loader (`load(path, trunk)`).
- `speculator`: `AssistantSpeculator`, k steps at one position.
"""
