"""verispec-draft-model: the `draft-model` speculator, a small model drafting for a big one.

- `hooks`: the entry point (SpeculatorSpec "draft-model"); no torch.
- `binding`: whether a draft trunk can draft for a trunk (tokenizers, rollback).
- `speculator`: `DraftModelSpeculator` (propose / commit / keep over a sequence in the draft trunk).
"""
