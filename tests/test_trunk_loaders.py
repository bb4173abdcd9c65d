"""Every trunk family's loader (all through verispec.gguf.load.load_trunk) refuses a file the
same way: a tensor its math would not read is errors.UnusedTensors naming it, never a silent
load of a file of another variant."""
import re

import pytest
import torch
from verispec.errors import UnusedTensors


@pytest.mark.parametrize("name", ["blk.1.mystery.weight", "mystery_head.weight"])
def test_an_unknown_tensor_is_refused_naming_it(tiny_trunk, tmp_path, name):
    path = tiny_trunk.write(tmp_path / "extra.gguf", tensors={name: torch.zeros(8)})
    with pytest.raises(UnusedTensors, match=re.escape(f"does not use: [{name!r}]")):
        tiny_trunk.load(path, dtype="float32", use_cache=False, tokenizer=False)
    tiny_trunk.load(tiny_trunk.write(tmp_path / "plain.gguf"), dtype="float32", use_cache=False, tokenizer=False)
