"""verispec-suffix: a weight-free suffix drafter over this request and earlier ones (see `verispec_suffix.speculator`)."""
