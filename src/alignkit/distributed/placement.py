"""``rollout.placement: separate``: the launched world split into trainer and generator processes.

The last ``M`` ranks of the world torchrun started generate, the others train (ARCHITECTURE 7c: who generates is
placement, not algorithm). :func:`split_world` joins the whole world's process group once and makes, collectively
on every rank, the groups the run uses:

* ``trainers``: ranks ``0 .. T-1``; a trainer's Strategy, DDP and the collective helpers (``comm.use_group``)
  work over it, and its :func:`~alignkit.distributed.env.read_env` is the trainers' world (``set_view``); a
  generator's helpers and view are the generators' own (ranks ``T .. T+M-1``);
* ``sync``: trainer rank 0 and the generators: the weights, broadcast in buckets from trainer rank 0 after every
  update (:func:`push_weights` / :func:`pull_weights`; NCCL on GPUs, gloo on CPUs: the world's backend);
* ``objects``: the whole world on gloo: samples, pickled into byte tensors and sent point to point
  (:func:`send_object` returns the pending sends: a generator never waits for a busy trainer to post its
  receive) and the start position a resumed run hands the generators.

Everything moves with torch.distributed; nothing here opens a socket of its own.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from alignkit.distributed import comm
from alignkit.distributed.env import DistEnv, read_launch_env, set_view
from alignkit.errors import ConfigError

#: bytes per weight bucket: a few large broadcasts instead of one per tensor (verl buckets its NCCL sync too)
BUCKET_BYTES = 64 * 2**20


@dataclass
class Placement:
    """This process's place in a split world: ``role`` ("trainer" | "generator"), the launched world ``env``,
    the trainers' count, the generators' global ranks, and the ``sync`` / ``objects`` groups (module
    docstring)."""

    role: str
    env: DistEnv
    trainers: int
    generators: list[int]
    sync: Any
    objects: Any

    @property
    def generator_index(self) -> int:
        """This generator's index among the generators (0 .. M-1)."""
        return self.env.rank - self.trainers


def split_world(generators: int, backend: str, device: torch.device, timeout_minutes: float = 30) -> Placement:
    """Join the launched world and split it (module docstring). Every rank calls it once, before its Strategy is
    set up (which then finds the process group made). ``backend``: the world's (nccl | gloo)."""
    env = read_launch_env()
    if env.world_size <= generators:
        raise ConfigError(f"rollout.placement: separate needs more processes than rollout.generator_processes "
                          f"({generators}): the launcher started {env.world_size}; start more (torchrun "
                          f"--nproc_per_node) or lower rollout.generator_processes")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(minutes=timeout_minutes)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    T = env.world_size - generators
    trainer_group = dist.new_group(list(range(T)))
    host = dist.new_group(list(range(T)), backend="gloo") if backend == "nccl" else None
    gens = list(range(T, env.world_size))
    generator_group = dist.new_group(gens)
    generator_host = dist.new_group(gens, backend="gloo") if backend == "nccl" else None
    sync = dist.new_group([0, *gens])
    objects = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    role = "trainer" if env.rank < T else "generator"
    # each side's collectives (statistics, data preparation) stay among its own processes
    mine, size, rank = (trainer_group, T, env.rank) if role == "trainer" else (generator_group, generators, env.rank - T)
    comm.use_group(mine, host if role == "trainer" else generator_host)
    set_view(DistEnv(rank, size, env.local_rank, env.local_world_size, env.master_addr, env.master_port))
    return Placement(role, env, T, gens, sync, objects)


def _buckets(tensors: list[torch.Tensor]) -> Iterable[list[int]]:
    """Indices of ``tensors`` in runs of one dtype of at most :data:`BUCKET_BYTES` (a larger tensor alone)."""
    run: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if run and (t.dtype != tensors[run[0]].dtype or size + nbytes > BUCKET_BYTES):
            yield run
            run, size = [], 0
        run.append(i)
        size += nbytes
    if run:
        yield run


def _sync_weights(module: nn.Module, group: Any, *, send: bool) -> None:
    """Broadcast ``module``'s parameters and buffers from the group's rank 0 (trainer rank 0) to the others, in
    flat buckets; the receivers copy them into their own module of the same architecture."""
    tensors = [t.data for t in (*module.parameters(), *module.buffers())]
    device = tensors[0].device if tensors else torch.device("cpu")
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    with torch.no_grad():
        for idx in _buckets(tensors):
            flat = torch.cat([tensors[i].reshape(-1).to(device) for i in idx]) if send else torch.empty(
                sum(tensors[i].numel() for i in idx), dtype=tensors[idx[0]].dtype, device=device)
            dist.broadcast(flat, group=group, group_src=0)
            if not send:
                offset = 0
                for i in idx:
                    n = tensors[i].numel()
                    tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                    offset += n


def push_weights(module: nn.Module, placement: Placement) -> None:
    """Trainer rank 0: send ``module``'s current weights to every generator (they call :func:`pull_weights`)."""
    _sync_weights(module, placement.sync, send=True)


def pull_weights(module: nn.Module, placement: Placement) -> None:
    """A generator: receive trainer rank 0's next :func:`push_weights` into ``module``."""
    _sync_weights(module, placement.sync, send=False)


@dataclass
class Sending:
    """Sends under way and the buffers they read (kept alive until :meth:`wait` returns)."""

    works: list[Any]
    buffers: list[torch.Tensor]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_object(obj: Any, dst: int, placement: Placement) -> Sending:
    """Start sending ``obj`` (pickled) to global rank ``dst`` over the objects group, without waiting for the
    receiver; wait on the result before the process ends."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    works = [dist.isend(size, dst, group=placement.objects), dist.isend(data, dst, group=placement.objects)]
    return Sending(works, [size, data])


def recv_object(src: int, placement: Placement) -> Any:
    """The next object global rank ``src`` sent this process with :func:`send_object`."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=placement.objects)
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(data, src, group=placement.objects)
    return pickle.loads(data.numpy().tobytes())


def broadcast_start(obj: Any, placement: Placement) -> Any:
    """Trainer rank 0's ``obj`` (where the run starts: a resumed run's position) on every generator; the other
    trainers get their own back."""
    if placement.role == "trainer" and placement.env.rank != 0:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=placement.sync, group_src=0)
    return box[0]
