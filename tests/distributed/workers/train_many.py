"""Worker: run several training configs one after another in ONE launched process group.

Each torchrun launch costs ~6-8 s of process start and imports, so the distributed tests put
several runs (and their checks) into one launch. Usage: ``torchrun ... train_many.py A.yaml B.yaml``;
a config may be followed by overrides, as ``alignkit train`` takes them: ``A.yaml key=value ... B.yaml``.
Rank 0 marks the start of each run on stderr (``output_of`` cuts one run's lines out of the launch's).
Ends with os._exit after destroy_process_group (gloo can abort at interpreter exit).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from alignkit.config import load_config
from alignkit.train.runner import run_train

MARK = "train_many: "


def output_of(stderr: str, path: str) -> str:
    """The part of a launch's ``stderr`` from the start of the run of config ``path`` to the next run's start
    (each run ends at a barrier, so both ranks' lines of a run lie between its mark and the next)."""
    return stderr.split(f"{MARK}{path}\n", 1)[1].split(MARK, 1)[0]


def runs(args: list[str]) -> list[tuple[str, list[str]]]:
    """Each config path with the ``key=value`` overrides that follow it."""
    out: list[tuple[str, list[str]]] = []
    for arg in args:
        if "=" in arg and out:
            out[-1][1].append(arg)
        else:
            out.append((arg, []))
    return out


def main(args: list[str]) -> None:
    for path, overrides in runs(args):
        if os.environ.get("RANK", "0") == "0":  # where each run's output starts (MARK + its config path)
            print(f"{MARK}{path}", file=sys.stderr, flush=True)
        run_train(load_config(path, overrides))
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
