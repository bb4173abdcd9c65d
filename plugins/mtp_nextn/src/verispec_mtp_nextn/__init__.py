"""verispec-mtp-nextn: the `mtp` speculator, chaining any PER_TOKEN draft head (NextN / MTP).

- `hooks`: the entry point (SpeculatorSpec "mtp"); no torch.
- `speculator`: `MtpSpeculator` (propose / commit / keep over per-sequence head state).
"""
