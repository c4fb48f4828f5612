"""The ``alignkit`` command; ``alignkit --help`` lists every sub-command (:func:`command_summary`).

User errors (bad config, bad data, missing files) end with one line ``alignkit: error: ...`` and exit
status 2; set ALIGNKIT_DEBUG=1 for the traceback. A run stopped by Ctrl-C or SIGTERM ends with one line
naming the checkpoint it saved and the resume command, and exits 130 / 143. Anything else is a bug and keeps
its traceback.
Under a launcher an error every rank raises alike is printed once, by local rank 0 (:func:`leave_to_rank0`).
The parser is built from light specs (``cli/parser.py``: every command's arguments and the ``"module:function"``
that runs it); the command's module is imported when the command runs, so ``alignkit --help`` loads no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from alignkit.cli.parser import build_parser, command_function, command_parser, command_summary
from alignkit.distributed.env import read_env
from alignkit.errors import Interrupted, UserError
from alignkit.launch.parent_death import arm_if_launched
from alignkit.logging import quiet_transformers

#: what is reported as one line; everything else is a bug and shows its traceback
USER_ERRORS = (UserError, FileNotFoundError)
__all__ = ["build_parser", "command_summary", "main"]


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher and ``torch.distributed.launch`` append ``--local_rank=N``;
    export it as LOCAL_RANK instead."""
    out = []
    for a in argv:
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        else:
            out.append(a)
    return out


def _finish(code: int) -> int:
    """Under several processes, end without Python finalization: gloo can abort at exit
    ("terminate called without an active exception") after all work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from alignkit.distributed.comm import exit_process

        exit_process(code)
    return code


def _quiet_deepspeed_on_cpu() -> None:
    """Without a GPU, DeepSpeed (imported by transformers whenever it is installed) warns "Setting
    accelerator to CPU ... we were unable to detect it" on every command; naming the CPU
    accelerator, which it would pick anyway, says the same without the warning."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


#: seconds a rank other than local rank 0 waits before printing a same-on-every-rank error itself
RANK0_GRACE_S = 5.0


def local_rank() -> int:
    """This process's rank on its node under a launcher (LOCAL_RANK, else RANK); 0 alone."""
    for name in ("LOCAL_RANK", "RANK"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def leave_to_rank0(error: BaseException) -> bool:
    """Whether this process leaves the line for ``error`` to local rank 0.

    True on a rank > 0 for errors every rank raises alike (``same_on_every_rank``: config, data and
    model errors, and missing files, all read the same by every rank of a node), so a run under
    torchrun says it once. Per node, not per job: another node may lack a file this one has, and its
    console is its own. Errors that can belong to one rank (pre-flight) are printed by that rank, and so
    is any error of a rank that finds itself still running ``RANK0_GRACE_S`` later (rank 0 did not fail alike).
    """
    same = getattr(error, "same_on_every_rank", isinstance(error, FileNotFoundError))
    return bool(same) and local_rank() > 0


def main(argv: list[str] | None = None) -> int:
    arm_if_launched()  # a worker of `alignkit launch` dies with its launcher (torchrun)
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a "*" positional at the first option: `CONFIG --gpus 8 a=b` leaves a=b over
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "algorithm", None):  # the seed guides' `--algorithm sft`
        args.overrides = [f"algorithm={args.algorithm}", *args.overrides]
    if getattr(args, "stage", None) and hasattr(args, "overrides"):  # the seed guides' `train_vlm.py --stage pretrain`
        args.overrides = [*args.overrides, f"vlm.stage={args.stage}"]
    _quiet_deepspeed_on_cpu()  # before the command's module imports transformers
    try:
        if args.command not in ("migrate", "data"):  # the commands that load or save models
            quiet_transformers(read_env().is_main)
        func: Callable[[argparse.Namespace], int] = command_function(args.func)
        code = func(args)
    except USER_ERRORS as e:
        if os.environ.get("ALIGNKIT_DEBUG"):
            raise
        who = ""
        if leave_to_rank0(e):
            # rank 0 prints the same line and exits, and the launcher then stops this process; still
            # here after the grace period (rank 0 did not fail alike), this rank says it itself
            time.sleep(RANK0_GRACE_S)
            who = f"(rank {local_rank()}) "
        print(f"alignkit: error: {who}{e}", file=sys.stderr)
        return _finish(2)
    except Interrupted as e:  # checkpoint.save_on_interrupt: saved at a step's end on every rank
        if local_rank() == 0:
            print(interrupted_line(e, args), file=sys.stderr)
        return _finish(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, the final save): nothing to resume
        if os.environ.get("ALIGNKIT_DEBUG"):
            raise
        if local_rank() == 0:
            print("alignkit: interrupted; nothing saved now (outside the training loop, or "
                  "checkpoint.save_on_interrupt=false); checkpoints written before resume exactly with "
                  "checkpoint.resume_from=latest", file=sys.stderr)
        return _finish(130)
    return _finish(code)


def interrupted_line(e: Interrupted, args: argparse.Namespace) -> str:
    """The one line an interrupted run ends with: where it stopped, what it saved, how to go on."""
    import shlex

    if e.checkpoint is None:
        return f"alignkit: {e}; nothing saved"
    overrides = [o for o in getattr(args, "overrides", []) if not o.startswith("checkpoint.resume_from=")]
    command = shlex.join(["alignkit", args.command, args.config, *overrides, "checkpoint.resume_from=latest"])
    how = " (under the same launcher)" if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
    return f"alignkit: {e}: saved {e.checkpoint}; resume with{how}: {command}"
