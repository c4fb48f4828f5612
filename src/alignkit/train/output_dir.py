"""A new run never mixes into the folder of another one.

Before, a second run into a used ``output_dir`` appended to its ``metrics.jsonl`` (steps 1,2,3,1,2,3, one
plot drawing both runs) and left ``latest`` naming the old run's checkpoint. Now a new run (no
``checkpoint.resume_from``, or a weights-only start) into a folder that holds a run is refused in one line,
unless ``checkpoint.overwrite_output_dir`` asks to move the old run aside first; nothing is deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from alignkit.config import RunConfig
from alignkit.errors import ConfigError
from alignkit.train.checkpoint import LATEST, find_latest, list_checkpoints

METRICS = "metrics.jsonl"
#: folders only a run writes: the final model (one per trained role) and the per-epoch exports
RUN_FOLDERS = ("final", "final_", "epoch_")


def run_marks(path: Path) -> list[str]:
    """What in ``path`` shows a run that trained: logged steps, checkpoints, ``latest``, a final or epoch
    model. Empty for a fresh folder, or one a run left before its first logged step (its ``config.yaml``
    and an empty ``metrics.jsonl`` hold nothing to lose, so fixing a config error and rerunning works)."""
    if not path.is_dir():
        return []
    marks = []
    metrics = path / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        marks.append(METRICS)
    ckpts = list_checkpoints(path)
    if ckpts:
        marks.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) > 1 else ''} up to {ckpts[-1].name}")
    if (path / LATEST).is_file():
        marks.append(LATEST)
    marks += sorted(p.name + "/" for p in path.iterdir() if p.is_dir() and p.name.startswith(RUN_FOLDERS))
    return marks


def run_algorithm(path: Path) -> str | None:
    """The algorithm of the run in ``path``: from its resolved ``config.yaml`` (written when it started),
    else from its newest checkpoint's copy."""
    latest = find_latest(path)
    for config in (path / "config.yaml", *((latest / "config.yaml",) if latest else ())):
        try:
            algorithm = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("algorithm")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(algorithm, str):
            return algorithm
    return None


def aside_path(path: Path) -> Path:
    """``OUTPUT_DIR.old-N`` beside ``path``, with the first N not taken."""
    n = 1
    while (aside := path.with_name(f"{path.name}.old-{n}")).exists():
        n += 1
    return aside


def check_reuse(cfg: RunConfig) -> str | None:
    """Refuse (one line) a new run into an ``output_dir`` that holds another run; with
    ``checkpoint.overwrite_output_dir`` move that run aside to ``OUTPUT_DIR.old-N`` and return a line saying
    so (None when the folder was free). A resume (``checkpoint.resume_from`` without weights only) is the
    same run going on and passes. Rank 0 only, before anything is written there."""
    ckpt = cfg.checkpoint
    if ckpt.resume_from is not None and not ckpt.resume_weights_only:
        return None
    path = Path(cfg.output_dir)
    marks = run_marks(path)
    if not marks:
        return None
    algorithm = run_algorithm(path)
    what = f"a run of {algorithm}" if algorithm else "a run"
    aside = aside_path(path)
    if not ckpt.overwrite_output_dir:
        raise ConfigError(f"output_dir {str(path)!r} holds {what} ({', '.join(marks)}): resume with "
                          "checkpoint.resume_from=latest, or choose a new output_dir, or set "
                          f"checkpoint.overwrite_output_dir=true (moves that run to {aside})")
    try:
        os.rename(path, aside)
    except OSError as e:  # e.g. output_dir is a mount point
        raise ConfigError(f"checkpoint.overwrite_output_dir: cannot move the run in {str(path)!r} aside to "
                          f"{aside} ({e.strerror or e}); move it yourself or choose a new output_dir") from None
    return f"output_dir: moved the previous {what.removeprefix('a ')} to {aside} (checkpoint.overwrite_output_dir)"
