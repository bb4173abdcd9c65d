"""tiny-head: a learned verispec draft head with its own GGUF (docs/plugins.md, the plugin author's guide)."""
