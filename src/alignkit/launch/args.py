"""What every ``alignkit launch`` path checks alike (one node, ``--slurm``, ``--k8s``): the launcher's name and
the process counts, refused in the same one line before any default replaces a bad value (``nnodes or 1`` would
turn ``--nnodes 0`` into one node)."""

from __future__ import annotations

from alignkit.errors import UserError

DEFAULT_PORT = 29500
LAUNCHERS = ("torchrun", "deepspeed", "accelerate")


class LaunchError(UserError, ValueError):
    """Bad launch arguments (a user error: one line, exit status 2)."""


def check_launch_args(*, nproc_per_node: int | None, nnodes: int | None, launcher: str = "torchrun") -> None:
    """Refuse a launcher alignkit does not know and a count below 1 (``None``: not given, the path's default)."""
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    bad = [f"{flag} {n}" for flag, n in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes))
           if n is not None and n < 1]
    if bad:
        raise LaunchError(f"--nproc-per-node and --nnodes must be >= 1, got {' and '.join(bad)}")
