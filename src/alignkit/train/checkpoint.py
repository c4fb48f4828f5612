"""Atomic checkpoints: written to a hidden temporary directory, fsynced, then renamed.

A crash (even kill -9) mid-write leaves at most a ``.tmp-checkpoint-*`` directory, which the
next run deletes; ``latest`` is replaced atomically only after the rename, so it always names a
complete checkpoint. Only rank 0 writes; RNG states of every rank are gathered to it first.

Layout of ``checkpoint-STEP/``: one folder per trainable role (``policy/``, ``value/``, ...) holding
its Hugging Face weights (or LoRA adapter) and the engine's training state; ``scheduler_rng.pt``
(every role's LR schedule, every rank's RNG), ``trainer_state.json`` (step, epoch, sampler position,
the algorithm's state such as a Lagrange multiplier) and the resolved ``config.yaml``. A checkpoint
written before roles existed (weights at the top level) still loads as the first role.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from alignkit.distributed import comm
from alignkit.errors import TrainingError
from alignkit.files import fsync_dir, write_text_atomic

if TYPE_CHECKING:
    from alignkit.distributed.strategy.base import Handle, Strategy

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-checkpoint-"
LATEST = "latest"
STATE_FILE = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    st = np.random.get_state()
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [st[0], st[1].tolist(), int(st[2]), int(st[3]), float(st[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(_tuplify(state["python"])))  # type: ignore[arg-type]
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def disk_full(error: BaseException, where: Path) -> bool:
    """Whether ``error`` (from torch.save, safetensors, ...) means the file system of ``where`` is full:
    errno ENOSPC, its message, or torch's "unexpected pos" write failure with (almost) no space left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
        return True
    if "unexpected pos" in text or "iostream error" in text:
        try:
            return shutil.disk_usage(where).free < 64 * 2**20
        except OSError:
            return True
    return False


def mount_point(path: Path) -> str:
    """The mount point of the file system holding ``path`` (what "DEVICE" means to a user)."""
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [
        p
        for p in output_dir.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=step_of)


def find_latest(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one."""
    pointer = output_dir / LATEST
    if pointer.is_file():
        cand = output_dir / pointer.read_text(encoding="utf-8").strip()
        if (cand / STATE_FILE).is_file():
            return cand
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def resolve_resume(output_dir: Path, resume_from: str | None) -> Path | None:
    if resume_from is None:
        return None
    if resume_from == "latest":
        return find_latest(output_dir)
    p = Path(resume_from)
    if p.is_dir() and not (p / STATE_FILE).is_file():
        inner = find_latest(p)  # an output_dir was given
        if inner is not None:
            return inner
    if not (p / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint.resume_from={resume_from!r} is not a complete checkpoint directory")
    return p


def clean_stale(output_dir: Path) -> None:
    """Remove what a crash left: a half-written checkpoint (``.tmp-``) or a half-deleted one (``.trash-``)."""
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)


def discard(path: Path) -> None:
    """Delete a checkpoint (or an exported model folder) so that a crash at any moment leaves it whole or
    invisible: it is renamed to a hidden trash name first (atomic; loaders ignore it, the next run removes it),
    then deleted."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name.removeprefix(PREFIX)}-{os.getpid()}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def tmp_dir(final: Path) -> Path:
    """The hidden folder ``final`` is written in before :func:`put_in_place` (the next run removes a stale one)."""
    return final.with_name(TMP_PREFIX + final.name.removeprefix(PREFIX))


def put_in_place(tmp: Path, final: Path) -> None:
    """Rank 0: ``tmp``'s files made durable (fsync), then ``tmp`` renamed to ``final`` (an older ``final``, e.g. a step
    saved again after a resume, discarded first): ``final`` is either absent, the old one or the new one, whole."""
    _fsync_tree(tmp)
    if final.exists():
        discard(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    strategy: Strategy,
    handles: dict[str, Handle],
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer: Any = None,  # one for every role, or {role: tokenizer or None}
    save_total_limit: int | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``checkpoint-STEP`` atomically (module docstring); every rank calls. ``extra(folder)``: every rank
    writes its own files (e.g. an algorithm's per-rank EMA) into the checkpoint before it is renamed."""
    final = output_dir / f"{PREFIX}{step}"
    tmp = tmp_dir(final)
    if strategy.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for role in handles:
            (tmp / role).mkdir()
    strategy.barrier()
    try:
        for role, handle in handles.items():
            strategy.save_model(handle, tmp / role, tokenizer.get(role) if isinstance(tokenizer, dict) else tokenizer)
            strategy.save_training_state(handle, tmp / role)
        if extra is not None:
            extra(tmp)
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as OSError, RuntimeError or SafetensorError
        if not disk_full(e, output_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        previous = find_latest(output_dir)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise TrainingError(f"no space left on {mount_point(output_dir)} while writing {final}; {kept} "
                            f"(free some space and resume with checkpoint.resume_from=latest)") from None
    rngs = comm.all_gather_object(rng_state())
    if strategy.is_main:
        schedulers = {role: h.scheduler.state_dict() for role, h in handles.items() if h.scheduler is not None}
        torch.save({"schedulers": schedulers, "rng": rngs}, tmp / "scheduler_rng.pt")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2), encoding="utf-8")
        put_in_place(tmp, final)
        write_text_atomic(output_dir / LATEST, final.name)
        if save_total_limit:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                discard(old)
    strategy.barrier()
    return final


def role_dir(ckpt: Path, role: str, first: bool) -> Path:
    """Where ``role`` lives in ``ckpt``; a checkpoint from before roles holds the first role at its top level."""
    inner = ckpt / role
    if inner.is_dir() or not first:
        if not inner.is_dir():
            raise FileNotFoundError(f"{ckpt}: no {role}/ folder; the checkpoint was written by a run without that role")
        return inner
    return ckpt


def load_checkpoint(ckpt: Path, *, strategy: Strategy, handles: dict[str, Handle],
                    load_schedulers: bool = True) -> dict[str, Any]:
    """Restore every role's weights, optimizer and LR schedule (unless ``load_schedulers`` is False: the
    caller rebuilds it) and this rank's RNG; returns the trainer state."""
    for i, (role, handle) in enumerate(handles.items()):
        strategy.load_training_state(handle, role_dir(ckpt, role, first=i == 0))
    extra = torch.load(ckpt / "scheduler_rng.pt", map_location="cpu", weights_only=True)
    schedulers = extra.get("schedulers") or {next(iter(handles)): extra["scheduler"]}
    for role, handle in handles.items():
        if load_schedulers and handle.scheduler is not None and role in schedulers:
            handle.scheduler.load_state_dict(schedulers[role])
    rngs = extra["rng"]
    if strategy.dp_rank < len(rngs):  # another world size: the caller says so (Checkpointer._note_layout)
        set_rng_state(rngs[strategy.dp_rank])
    return json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
