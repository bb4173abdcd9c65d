"""verispec-gemma4: Gemma 3 and Gemma 4 trunks for verispec (see hooks.py for what it registers)."""
__version__ = "0.1.0"
