"""verispec-nemotron: NVIDIA Nemotron-H trunks (Mamba-2 + attention + relu² MLP / MoE hybrids)."""
