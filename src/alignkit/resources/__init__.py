"""Files shipped inside the package: the tokenizer corpus and the synthetic data sets.

``scripts/make_resources.py`` regenerates them. Data sets are addressed as ``builtin:NAME`` in
configs (``alignkit.constants.BUILTIN_PREFIX``); ``resource_path`` turns ``NAME`` into a path.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alignkit.constants import BUILTIN_PREFIX


def _root() -> Path:
    """The ``alignkit/resources`` directory (the package is installed as plain files, not a zip)."""
    return Path(str(files("alignkit") / "resources"))


def available() -> list[str]:
    """Names ``resource_path`` accepts: the data sets first, then the top-level files."""
    root = _root()
    data = sorted(p.name for p in (root / "data").glob("*") if p.is_file())
    top = sorted(p.name for p in root.glob("*") if p.is_file() and p.suffix != ".py")
    return data + top


def resource_path(name: str) -> Path:
    """Path of the shipped file ``name`` (``"sft_train.jsonl"``, ``"corpus.txt"``).

    Looks in ``resources/data/`` then ``resources/``; a leading ``builtin:`` is accepted. Raises
    ``FileNotFoundError`` listing the available names when there is no such file.
    """
    name = name.removeprefix(BUILTIN_PREFIX)
    root = _root()
    # A bare file name only: "../" must not reach outside the resources.
    if name and Path(name).name == name:
        for candidate in (root / "data" / name, root / name):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"no shipped resource {name!r}; available: {', '.join(available())}")
