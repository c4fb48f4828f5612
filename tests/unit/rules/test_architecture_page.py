"""docs/architecture.md stays true to the tree, by path: every module under src/alignkit is named in the page's
Rooms table by its path, every path the page names exists, and the at-a-glance tree names real files and every
folder of the package.

How a name is read: in a row of the Rooms table (or a line of the at-a-glance tree) whose subject is a folder
(``cli/``), a backticked ``x.py`` or ``a/b.py`` is that folder's file, else a path from the package root
(``losses/rl.py`` in the ``rollout/`` row); in a row of top-level modules, a path from the package root; a file
outside the package, its path from the repository root. Naming a folder names its ``__init__.py``. Elsewhere on
the page a module is named by its path from the package root or the repository root
(``tests/plugins/bandit_kind.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "src" / "alignkit"
PAGE = ROOT / "docs" / "architecture.md"
#: a backticked module (``x.py``, ``a/b.py``) or folder (``a/``) of the page
PATH = re.compile(r"`([\w./]+?(?:\.py|/))`")
#: a module or folder in the at-a-glance tree (not backticked there)
TREE_PATH = re.compile(r"(?<![\w./-])([\w/]+(?:\.py|/))(?![\w/])")


def section(text: str, title: str) -> str:
    """The text under ``## title`` up to the next ``## `` heading."""
    assert f"\n## {title}\n" in text, f"docs/architecture.md has no '## {title}' section"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def resolve(name: str, folder: Path) -> Path | None:
    """``name`` as a row of ``folder`` reads it: the folder's own file, else a path from the package root (or,
    for a file outside the package, from the repository root)."""
    for base in (folder, PKG, ROOT):
        if (base / name).exists():
            return base / name
    return None


def rows(text: str) -> list[tuple[Path, list[str], list[str]]]:
    """Each row of the Rooms table: (its folder, the paths of its first cell, the paths of its description)."""
    out = []
    for line in section(text, "Rooms").splitlines():
        if not line.startswith("| `"):
            continue
        subject, description = line[1:].split("|", 1)
        subjects = PATH.findall(subject)
        folders = [s for s in subjects if s.endswith("/")]
        assert folders == subjects[:1] == subjects or not folders, \
            f"a row is about one folder or about top-level modules, not both: {subject.strip()}"
        out.append((PKG / folders[0] if folders else PKG, subjects, PATH.findall(description)))
    assert len(out) > 10, "the Rooms table must be read"
    return out


def named_in_rooms(text: str) -> tuple[set[Path], list[str]]:
    """The modules the Rooms table names (a folder: its ``__init__.py``) and the names that resolve to nothing."""
    named, unknown = set(), []
    for folder, subjects, names in rows(text):
        for name in [*subjects, *names]:
            path = resolve(name, PKG if name in subjects else folder)
            if path is None:
                unknown.append(f"{name} (row {folder.relative_to(PKG.parent)})")
            elif path.is_dir():
                named.add(path / "__init__.py")
            else:
                named.add(path)
    return named, unknown


def test_every_module_is_named_in_the_rooms_table_by_its_path() -> None:
    named, unknown = named_in_rooms(PAGE.read_text(encoding="utf-8"))
    assert not unknown, f"the Rooms table names paths that do not exist: {unknown}"
    missing = [str(f.relative_to(PKG)) for f in sorted(PKG.rglob("*.py")) if f not in named]
    assert not missing, f"modules the Rooms table does not name by their path: {missing}"


def test_every_path_elsewhere_on_the_page_exists() -> None:
    """Outside the Rooms table, a module is named by its full path (from the package or the repository root)."""
    text = PAGE.read_text(encoding="utf-8")
    rest = text.replace(section(text, "Rooms"), "")
    # modules, and folders of more than one part (``final/`` is a run's output folder, not a path of the tree)
    names = [n for n in PATH.findall(rest) if n.endswith(".py") or "/" in n.rstrip("/")]
    assert len(names) > 10, "the page's paths must be read"
    unknown = [n for n in names if not (PKG / n).exists() and not (ROOT / n).exists()]
    assert not unknown, f"docs/architecture.md names paths that do not exist: {unknown}"


def test_the_tree_at_a_glance_names_real_files_and_every_folder() -> None:
    tree = section(PAGE.read_text(encoding="utf-8"), "At a glance").split("```")[1]
    lines = [line for line in tree.splitlines() if line.startswith("  ") and line.strip()]
    seen, unknown = set(), []
    for line in lines:
        head, _, description = line.strip().partition("  ")  # ``ops/ losses/``: the line's subjects
        subjects = TREE_PATH.findall(head)
        folder = PKG / subjects[0] if len(subjects) == 1 and subjects[0].endswith("/") else PKG
        for name in subjects:
            seen.add(name.rstrip("/"))
            unknown += [] if resolve(name, PKG) else [name]
        unknown += [f"{name} ({line.split()[0]})" for name in TREE_PATH.findall(description)
                    if resolve(name, folder) is None]
    assert not unknown, f"the tree at a glance names paths that do not exist: {unknown}"
    folders = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert [f for f in folders if f not in seen] == [], "every folder of the package has its line in the tree"


@pytest.mark.parametrize("bad, why", [
    ("| `rollout/` | `nowhere.py` (gone) |", "nowhere.py (row alignkit/rollout)"),
    ("| `rollout/` | `step.py` (a train module, named bare in another folder's row) |",
     "step.py (row alignkit/rollout)"),
])
def test_a_name_that_resolves_to_nothing_fails(bad: str, why: str) -> None:
    text = PAGE.read_text(encoding="utf-8").replace("\n## Rooms\n", "\n## Rooms\n\n" + bad + "\n", 1)
    assert why in named_in_rooms(text)[1]


def test_a_module_named_only_in_another_folders_row_is_missing() -> None:
    """``scorers.py`` named in the ``cli/`` row is no name of ``rewards/scorers.py``: the row's folder decides."""
    text = PAGE.read_text(encoding="utf-8")
    row = next(line for line in section(text, "Rooms").splitlines() if line.startswith("| `rewards/`"))
    moved = text.replace(row, row.replace("`scorers.py`", "`the scorers`")).replace(
        "\n## Rooms\n", "\n## Rooms\n\n| `cli/` | `scorers.py` |\n", 1)
    assert PKG / "rewards" / "scorers.py" in named_in_rooms(text)[0]
    named, unknown = named_in_rooms(moved)
    assert PKG / "rewards" / "scorers.py" not in named and "scorers.py (row alignkit/cli)" in unknown
