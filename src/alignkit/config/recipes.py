"""The shipped recipes (the repository's ``configs/*.yaml``) as a config path resolves against them: a
``configs/NAME.yaml`` the current folder lacks is read from the clone's (a docs block run from an empty folder),
and a path that names no file is told the shipped recipe it most likely meant."""

from __future__ import annotations

import difflib
from pathlib import Path

from alignkit.config.aliases import emit_notes
from alignkit.constants import RECIPES_DIR
from alignkit.errors import ConfigError


def recipes() -> list[str]:
    """The shipped recipes: the configs/*.yaml of the repository (or of the current folder)."""
    folder = RECIPES_DIR if RECIPES_DIR.is_dir() else Path("configs")
    return sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []


def locate(path: str | Path) -> Path:
    """The config file ``path`` names: itself, or for a ``configs/NAME.yaml`` missing here the shipped recipe (said
    on stderr, rank 0 only); a one-line error otherwise, naming the closest shipped recipe where one is close."""
    p = Path(path)
    shipped = RECIPES_DIR / p.name
    if not p.is_file() and p.parent == Path("configs") and shipped.is_file():
        emit_notes([f"config: {p} is not in this folder; reading the shipped recipe {shipped}"])
        return shipped
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml"
    close = difflib.get_close_matches(name, recipes(), n=1, cutoff=0.75)
    hint = f" (did you mean configs/{close[0]}, a shipped recipe?)" if close else ""
    raise ConfigError(f"config file {str(p)!r} does not exist{hint}")
