"""Rank / world size / local rank from the environment any launcher sets.

torchrun, ``deepspeed`` and ``accelerate launch`` all export RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; the ``deepspeed`` launcher may instead pass ``--local_rank=N``
on the command line, which the CLI strips and exports as LOCAL_RANK before we read it here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from alignkit.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: str | None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


#: this process's view of the world when ``rollout.placement: separate`` splits it (distributed/placement.py):
#: a trainer sees the trainers alone (its rank among them, their count), so the Strategy, the batch plan and the
#: data shards count trainers; None: the launched world as it is
_VIEW: list[DistEnv | None] = [None]


def set_view(view: DistEnv | None) -> None:
    """What :func:`read_env` returns from now on (None: the launcher's environment again)."""
    _VIEW[0] = view


def read_env() -> DistEnv:
    """This process's data-parallel world: the view :func:`set_view` set, else the launcher's environment."""
    return _VIEW[0] if _VIEW[0] is not None else read_launch_env()


def read_launch_env() -> DistEnv:
    """Read the launcher's environment; a plain ``python`` run is rank 0 of 1."""
    world = _int("WORLD_SIZE", 1)
    rank = _int("RANK", 0)
    local_rank = _int("LOCAL_RANK", rank if world > 1 else 0)
    local_world = _int("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=os.environ.get("MASTER_ADDR"),
        master_port=os.environ.get("MASTER_PORT"),
    )
