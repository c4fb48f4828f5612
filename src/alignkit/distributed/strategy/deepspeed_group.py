"""DeepSpeed on the trainers' group of a split world (``rollout.placement: separate``).

DeepSpeed runs its collectives without a group (checkpoint barriers, tag validation, its world size and rank) on
the default one, the whole launched world, and clones that world for ZeRO's data-parallel group; the generator
ranks are in the world but never call them. :func:`use_trainers_group` makes the trainers' group DeepSpeed's
world: every call of its communication backend that names no group (or the whole world) gets the trainers' group,
and the clone of the world it partitions over is that group. Trainers are global ranks ``0 .. T-1``, so the global
ranks DeepSpeed passes (broadcast sources) name the same processes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch.distributed as dist

#: DeepSpeed's backend calls that reduce over a group (the whole world when none is named)
COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "broadcast",
               "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
               "gather", "scatter", "barrier", "monitored_barrier", "get_rank", "get_world_size")


def _signature(method: Any) -> list[str]:
    """The parameter names of ``method`` under DeepSpeed's decorators (they hide them behind ``*args, **kwargs``):
    of the first function among it and the functions its closures hold (a few levels deep) that takes a group."""
    level = [getattr(method, "__func__", method)]
    for _ in range(4):
        for fn in level:
            names = [n for n in inspect.signature(fn).parameters if n != "self"]
            if "group" in names:
                return names
        level = [c.cell_contents for fn in level for c in (fn.__closure__ or ()) if inspect.isfunction(c.cell_contents)]
    raise TypeError(f"{method}: no group parameter found")


def _defaulting(method: Any, group: Any) -> Any:
    """``method`` with ``group`` where its caller gave none (or the whole world)."""
    at = _signature(method).index("group")

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > at:
            if args[at] is None or args[at] is dist.GroupMember.WORLD:
                args = (*args[:at], group, *args[at + 1 :])
        elif kwargs.get("group") is None or kwargs.get("group") is dist.GroupMember.WORLD:
            kwargs["group"] = group
        return method(*args, **kwargs)

    return call


def use_trainers_group(group: Any) -> None:
    """Make ``group`` DeepSpeed's world (module docstring); after ``deepspeed.init_distributed``."""
    redirect(importlib.import_module("deepspeed.comm.comm").cdb, group)
    backend = importlib.import_module("deepspeed.comm.comm").cdb
    backend.get_world_group = lambda: group
    importlib.import_module("deepspeed.utils.groups")._WORLD_GROUP = group


def redirect(backend: Any, group: Any) -> None:
    """Each of ``backend``'s :data:`COLLECTIVES` defaulting to ``group``; a second call (a second run in one
    process, with a new group) replaces the first's wrapper instead of wrapping it (which would find no group)."""
    for name in COLLECTIVES:
        if hasattr(backend, name):
            current = getattr(backend, name)
            original = getattr(current, "_before_trainers_group", current)
            wrapped = _defaulting(original, group)
            wrapped._before_trainers_group = original  # type: ignore[attr-defined]
            setattr(backend, name, wrapped)
