"""Following the docs and the shipped recipes from the repository root leaves nothing in it: what they write (runs,
generated data, plots, answers, images) goes under ``runs/`` (git-ignored), or under ``models/`` where a page
follows the seed guides' Safe-RLHF layout (``models/helpful_rm``, ``models/aligned``), also git-ignored
(issue 42.7). A static scan: the recipes' output and data paths, and every path a docs command writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.conftest import REPO

WRITABLE = ("runs/", "models/")
RECIPES = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "examples").glob("*.yaml")])
PAGES = sorted([REPO / "README.md", REPO / "examples" / "README.md", *(REPO / "docs").glob("*.md"),
                *(REPO / "docs" / "workflows").glob("*.md")])
FENCE = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", flags=re.DOTALL)
#: options whose value is a path a command writes
OUT_OPTIONS = ("--out", "--output-dir", "--output_dir")


def _local(path: str) -> bool:
    """A path in the working folder (not a builtin: file, a Hub id, an absolute path or a placeholder)."""
    return not (path.startswith(("builtin:", "/", "$", "~")) or path.isupper() or path in ("null", ""))


def _data_paths(cfg: dict[str, Any]) -> Iterator[tuple[str, str]]:
    data = cfg.get("data") or {}
    for key in ("train", "eval", "image_root"):
        value = data.get(key)
        for item in value if isinstance(value, list) else [value]:
            path = item.get("path") if isinstance(item, dict) else item
            if isinstance(path, str) and re.search(r"\.(jsonl?|parquet|csv)$|^data/|image_root", path + key):
                yield f"data.{key}", path


def _written(words: list[str]) -> Iterator[str]:
    """The paths an ``alignkit`` command line writes: --out / --output-dir values, output_dir= overrides,
    tiny-model's folder, and a shell redirect's target."""
    for i, word in enumerate(words):
        if word in OUT_OPTIONS and i + 1 < len(words):
            yield words[i + 1]
        elif word.startswith(tuple(o + "=" for o in OUT_OPTIONS)) or word.startswith("output_dir="):
            yield word.split("=", 1)[1]
        elif word == ">" and i + 1 < len(words):
            yield words[i + 1]
    if words[1:2] == ["tiny-model"] and len(words) > 2 and not words[2].startswith("-"):
        yield words[2]


def _commands(page: Path) -> Iterator[list[str]]:
    for body in FENCE.findall(page.read_text(encoding="utf-8")):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip().lstrip("#").strip()  # a recipe's comment lines are commands too
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            try:
                tokens = list(lexer)
            except ValueError:
                continue
            command: list[str] = []
            for token in [*tokens, ";"]:  # one command per '&&', '|', ';' piece (mkdir -p runs && alignkit ...)
                if token not in ("&&", "||", "|", ";"):
                    command.append(token)
                    continue
                if command[:1] == ["alignkit"]:
                    yield command
                command = []


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipes_write_and_read_under_runs(recipe: Path) -> None:
    cfg = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    assert str(cfg["output_dir"]).startswith(WRITABLE), f"{recipe.name}: output_dir {cfg['output_dir']!r}"
    for key, path in _data_paths(cfg):
        assert not _local(path) or path.startswith(WRITABLE), f"{recipe.name}: {key} {path!r} is not under runs/"
    for line in recipe.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#") and "alignkit " in line:
            words = shlex.split(line.split("alignkit ", 1)[1].split("  #")[0])
            for path in _written(["alignkit", *words]):
                assert not _local(path) or path.startswith(WRITABLE), f"{recipe.name}: {line.strip()!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_commands_write_under_runs(page: Path) -> None:
    for words in _commands(page):
        for path in _written(words):
            assert not _local(path) or path.startswith(WRITABLE), \
                f"{page.relative_to(REPO)}: {' '.join(words)!r} writes {path!r} outside runs/"


def test_the_scan_sees_what_the_old_pages_wrote() -> None:
    """The patterns the pages used before (issue 42.7) are caught, so the scan can fail."""
    old = ["alignkit plot runs/dpo --out curves.png",
           "alignkit data synth --kind vlm --stage sft --split train --n 3000 --out data/shapes/sft.json",
           "alignkit generate configs/flow_grpo.yaml prompts.jsonl --out grids",
           "alignkit train configs/sft.yaml output_dir=out"]
    for line in old:
        assert [p for p in _written(shlex.split(line)) if not p.startswith(WRITABLE)], line
    assert list(_data_paths({"data": {"train": ["data/shapes/sft.json"], "image_root": "data/shapes"}}))
