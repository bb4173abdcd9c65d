"""verispec-ngram: a weight-free n-gram lookup drafter (see `verispec_ngram.speculator`)."""
