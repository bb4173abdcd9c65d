"""verispec-eagle3: EAGLE-3 draft heads in llama.cpp's `eagle3` GGUF format, as a PER_TOKEN draft head.

- `hooks`: entry point (the `eagle3` drafter file and speculator); no torch.
- `config`: the GGUF's keys and tensor shapes (`Eagle3Config.from_gguf`).
- `binding`: whether a head fits a trunk (`binding_problem`).
- `modeling`: the one decoder layer's math over m rows (`Eagle3Layer`).
- `head`: the PER_TOKEN `DraftHead` (`Eagle3Head`): its KV per sequence, catch-up, draft steps.
- `loader`: the `DraftFileSpec` loader (`load(path, trunk)`).
- `gguf_writer`: writes the same format (`write_eagle3_gguf`).
- `speculator`: `Eagle3Speculator`, the test-time-recurrence chain.
"""
