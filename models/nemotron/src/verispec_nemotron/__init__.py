"""verispec-nemotron: NVIDIA Nemotron-H trunks for verispec (see hooks.py for what it registers)."""
__version__ = "0.1.0"
