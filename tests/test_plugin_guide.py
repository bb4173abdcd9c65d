"""docs/plugins.md and README's "Writing a plugin" quote the example plugins: every fenced code
block whose first line is `# examples/...` (a file's path) must be a verbatim slice of that file,
so the guide cannot drift from the code ./test.sh runs."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```[a-z]*\n# (examples/\S+)\n(.*?)^```", re.S | re.M)


def quoted(doc: str) -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / doc).read_text())


@pytest.mark.parametrize("doc", ["docs/plugins.md", "README.md"])
def test_every_quoted_block_is_a_slice_of_the_example_it_names(doc):
    blocks = quoted(doc)
    assert blocks, f"{doc} quotes no example file"
    for path, code in blocks:
        source = (ROOT / path).read_text()
        assert code in source, f"{doc}: the block quoting {path} is not in that file:\n{code}"


def test_the_guide_quotes_both_examples_and_every_section_has_code():
    paths = {path for path, _ in quoted("docs/plugins.md")}
    assert any(p.startswith("examples/plugins/line-copy/") for p in paths)
    assert any(p.startswith("examples/plugins/tiny-head/") for p in paths)
    sections = re.split(r"^## ", (ROOT / "docs/plugins.md").read_text(), flags=re.M)[1:]
    assert all(BLOCK.search(section) for section in sections), "a guide section quotes no example"
