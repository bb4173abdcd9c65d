"""GGUF files: reading one, checking its numbers, loading it into a family's module, its vocabulary.

- `header`: the parser: header, metadata and tensor table from a memory map (`parse`, `read_architecture`).
- `io`: `GGUFFile`: open and validate a file, typed metadata, tensors as torch (dequantised by gguf-py).
- `errors`: the errors of reading a GGUF (`GGUFError` and its kinds), each naming the file and the fix.
- `checks`: what a file's numbers must satisfy before a trunk is built (`check_numbers`, `check_finite`).
- `table`: a family's tensor table as typed rows (`Tensor`, `Stack`).
- `load`: the loader every family calls: its table drives GGUF -> module state (`plan_weights`, `load_trunk`).
- `vocab`: a file's `tokenizer.ggml.*` keys as a `tokenizers.Tokenizer` (transformers' converter), cached
  (`load_backend`); `verispec.tokenizer` wraps it.
- `shard`: one tensor-parallel rank's view of a file, each split tensor cut to its slice (`ShardedGGUF`).

Imports run errors <- header <- io <- checks, shard <- load (table beside them; io <- vocab). gguf-py, the PyPI
package these read through (`import gguf`: `gguf.constants`, `gguf.quants`), is another package.
"""
