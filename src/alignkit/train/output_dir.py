"""A new run never mixes into the folder of another one.

Before, a second run into a used ``output_dir`` appended to its ``metrics.jsonl`` (steps 1,2,3,1,2,3, one
plot drawing both runs) and left ``latest`` naming the old run's checkpoint. Now a new run (no
``checkpoint.resume_from``, or a weights-only start) into a folder that holds a run is refused in one line,
unless ``checkpoint.overwrite_output_dir`` asks to move the old run aside first; nothing is deleted.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from alignkit.config import RunConfig
from alignkit.errors import ConfigError, UserError
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


#: the lock file a running run holds in its output_dir (rank 0): an OS lock, released when the process dies
LOCK_FILE = ".alignkit.lock"
#: output_dir (resolved) -> the open lock file of the run this process holds it for
_held: dict[str, Any] = {}


def hold(path: Path) -> None:
    """Take ``path``'s run lock for this process (rank 0, once ``path`` exists): ``fcntl.flock`` on
    ``LOCK_FILE``, held until :func:`release` or the process's end (the OS drops it when the process dies, even by
    SIGKILL: a crashed run never leaves the folder stuck). The holder's pid and host are written into the file; a
    second run into the folder while it is held is refused in one line naming them. Where the file system has no
    locks (some network mounts) or the OS no ``fcntl``, the run goes on unlocked."""
    key = str(path.resolve())
    if key in _held:  # the same process again (a second run_train in one interpreter)
        return
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        return
    fh = (path / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            fh.close()
            return  # ENOLCK / EOPNOTSUPP: no locks on this file system
        holder = _holder(fh)
        fh.close()
        raise OutputDirInUse(f"output_dir {str(path)!r} is in use by another run ({holder}); wait for it to end, "
                             "or choose another output_dir") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    fh.flush()
    _held[key] = fh


def _holder(fh: Any) -> str:
    """Who holds the lock, as its holder wrote it (read again for a moment: it writes just after locking)."""
    for _ in range(20):
        fh.seek(0)
        text = fh.read().strip()
        if text:
            return text
        time.sleep(0.05)
    return "pid and host not written yet"


def release(path: Path) -> None:
    """Let go of ``path``'s run lock (the end of a run); a no-op where this process does not hold it."""
    fh = _held.pop(str(path.resolve()), None)
    if fh is not None:
        fh.close()  # closing the last descriptor drops the flock


class OutputDirInUse(UserError):
    """A second run into an output_dir another run holds (only rank 0 takes the lock, and it prints)."""
