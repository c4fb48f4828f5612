"""A process started by ``alignkit launch`` dies with its parent (Linux ``prctl(PR_SET_PDEATHSIG)``).

torchrun starts its workers in sessions of their own, so a SIGKILL to the launcher's process group reaches the
launcher and torchrun but not the workers, which would train on, orphaned, into the same ``output_dir``. Armed in
torchrun (before it execs, by :func:`run.run_launch`) and in every worker at start-up (:func:`arm_if_launched`, as
``LAUNCHED_ENV`` marks it), each process gets a signal when its parent dies: torchrun SIGTERM (it stops its workers
as it does on any SIGTERM), a worker SIGKILL (its launcher is gone, nothing of the run can go on). Elsewhere than
Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

#: set in the environment of what ``alignkit launch`` starts: a worker that sees it arms its parent-death signal
LAUNCHED_ENV = "ALIGNKIT_LAUNCHED"
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that started it ends; False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def arm(sig: int, parent: int) -> None:
    """Arm ``sig``; when ``parent`` already died before that (the signal would never come; an orphan's parent is
    init, pid 1), take it now."""
    if set_parent_death_signal(sig) and (os.getppid() != parent or parent == 1):
        os.kill(os.getpid(), sig)


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies."""
    parent = os.getpid()
    return lambda: arm(sig, parent)


def arm_if_launched(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """In a worker of ``alignkit launch`` (``LAUNCHED_ENV`` set): SIGKILL when the launcher under it dies."""
    if env.get(LAUNCHED_ENV) != "1":
        return False
    arm(signal.SIGKILL, os.getppid())
    return True
