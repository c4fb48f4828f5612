"""Collective helpers for metrics and statistics.

This is the only place algorithm-facing code reaches ``torch.distributed``: every helper is a
no-op (identity) in a single process, so algorithms, losses and data never branch on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


#: the process group these helpers reduce over: None = the whole world; the trainers' group when
#: ``rollout.placement: separate`` splits the world (``distributed/placement.py``), so a trainer's statistics
#: never wait for a generator
_GROUP: list[Any] = [None]


def use_group(group: Any, host_group: Any = None) -> None:
    """Make every helper here work over ``group`` (and host-side numbers over ``host_group``, a gloo group of
    the same ranks, when ``group`` is NCCL); None: the whole world."""
    _GROUP[0] = group
    _HOST_GROUP.clear()
    if host_group is not None:
        _HOST_GROUP.append(host_group)


def group() -> Any:
    """The process group of this process's data-parallel peers (None: the default, whole world)."""
    return _GROUP[0]


def world_size() -> int:
    return dist.get_world_size(group()) if is_initialized() else 1


def rank() -> int:
    return dist.get_rank(group()) if is_initialized() else 0


def _comm_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo reduces CPU tensors."""
    if dist.get_backend(group()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(t: torch.Tensor, op: "dist.ReduceOp") -> torch.Tensor:
    if not is_initialized():
        return t.detach().clone()
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out, op=op, group=group())
    return out.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor on ``t``'s device; the input is untouched)."""
    return _reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.MAX)


_HOST_GROUP: list[Any] = []  # a gloo group for host-side numbers when the default backend is NCCL


def _host_group() -> Any:
    """The process group that reduces CPU tensors: the default one under gloo, else a gloo group made
    once (collectively: every rank reaches its first host reduction at the same point of the step)."""
    if dist.get_backend(group()) != "nccl":
        return group()
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def all_reduce_host_sum(values: list[float]) -> list[float]:
    """Sum over ranks of numbers the host already has (loss-unit counts from the collators), without a
    trip through the accelerator: an NCCL reduction would need a device copy and a sync to read back."""
    if not is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_host_group())
    return t.tolist()


def all_gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank along dim 0, in rank order."""
    if not is_initialized():
        return t.detach().clone()
    src = t.detach().to(_comm_device()).contiguous()
    parts = [torch.empty_like(src) for _ in range(world_size())]
    dist.all_gather(parts, src, group=group())
    return torch.cat(parts, dim=0).to(t.device)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (pickled; for small things only)."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=group())
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src``: a rank of :func:`group`)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group(), group_src=src)
    return box[0]


def broadcast_tensor(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s values of ``t`` on every rank (a new tensor; ``src``: a rank of :func:`group`)."""
    if not is_initialized():
        return t.detach().clone()
    out = t.detach().to(_comm_device(), copy=True)
    dist.broadcast(out, group=group(), group_src=src)
    return out.to(t.device)


def barrier() -> None:
    if is_initialized():
        dist.barrier(group=group())


def stack_on_one_device(values: list[torch.Tensor]) -> torch.Tensor:
    """``(N,)`` float64 of 0-d ``values`` that may sit on the CPU and one accelerator: stacked on the
    accelerator, so reading them back is one transfer."""
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    return torch.stack([v.reshape(()).to(device, torch.float64) for v in values])


def reduce_metrics(sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Global mean of each metric: sum and count are reduced separately (no mean of means).

    All values travel in one flat tensor so a step costs one all-reduce however many metrics.
    """
    names = sorted(sums)
    if not names:
        return {}
    flat = stack_on_one_device([sums[n].detach() for n in names] + [counts[n].detach() for n in names])
    host = all_reduce_sum(flat).tolist()  # one read-back for every metric
    k = len(names)
    return {n: host[i] / host[k + i] if host[k + i] > 0 else float("nan") for i, n in enumerate(names)}


def exit_process(code: int = 0, *, barrier: bool = False) -> None:
    """End this process now, without Python finalization, after leaving the process group (if any).

    gloo can abort at interpreter exit ("terminate called without an active exception") after all
    work is done (ENGINES_ON_CPU.md: about 1 exit in 5); ``os._exit`` after
    ``destroy_process_group`` avoids it. ``barrier`` first waits for every rank."""
    import os
    import sys

    if is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
