"""line-copy: a weight-free verispec drafter (docs/plugins.md, the plugin author's guide)."""
