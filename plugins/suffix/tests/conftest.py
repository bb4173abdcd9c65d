"""The brute-force references (`suffix_brute.py`) sit beside this file."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # suffix_brute, under --import-mode=importlib
