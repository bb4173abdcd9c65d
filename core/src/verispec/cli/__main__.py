"""`python -m verispec.cli`: the `verispec` command."""
import sys

from verispec.cli.main import main

sys.exit(main())
