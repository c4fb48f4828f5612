"""``rollout.placement: separate``: the launched world split into trainer and generator processes.

The last ``M`` ranks of the world torchrun started generate, the others train (ARCHITECTURE 7c: who generates is
placement, not algorithm). :func:`split_world` joins the whole world's process group once and makes, collectively
on every rank, the groups the run uses:

* ``trainers``: ranks ``0 .. T-1``; a trainer's Strategy, DDP and the collective helpers (``comm.use_group``)
  work over it, and its :func:`~alignkit.distributed.env.read_env` is the trainers' world (``set_view``); a
  generator's helpers and view are the generators' own (ranks ``T .. T+M-1``);
* ``sync``: trainer rank 0 and the generators: the weights, broadcast in buckets from trainer rank 0 after every
  update (:func:`push_weights` / :func:`pull_weights`; NCCL on GPUs, gloo on CPUs: the world's backend); sharded
  trainers (FSDP2) gather each bucket together over their own group first; a LoRA policy sends its adapters alone,
  after :func:`check_base` found the generators' frozen base equal to the trainers';
* ``objects``: the whole world on gloo: samples, pickled into byte tensors and sent point to point
  (:func:`send_object` returns the pending sends: a generator never waits for a busy trainer to post its
  receive) and the start position a resumed run hands the generators.

Everything moves with torch.distributed; nothing here opens a socket of its own.
"""

from __future__ import annotations

import hashlib
import pickle
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

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


def check_world(generators: int, world_size: int) -> None:
    """One line when the launched world leaves no trainer (``alignkit launch`` checks it before starting torchrun,
    every rank again in :func:`split_world`)."""
    if world_size <= generators:
        raise ConfigError(f"rollout.placement: separate needs more processes than rollout.generator_processes "
                          f"({generators}): the launcher starts {world_size}; start more (--nproc-per-node, "
                          f"--nnodes) or lower rollout.generator_processes")


def split_world(generators: int, backend: str, device: torch.device, timeout_minutes: float = 30) -> Placement:
    """Join the launched world and split it (module docstring). Every rank calls it once, before its Strategy is
    set up (which then finds the process group made). ``backend``: the world's (nccl | gloo)."""
    env = read_launch_env()
    check_world(generators, env.world_size)
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


#: gathers some (possibly sharded) tensors whole on every trainer, collectively (``Strategy.gathered``)
Gather = Callable[[list[torch.Tensor]], AbstractContextManager[list[torch.Tensor]]]


@contextmanager
def as_is(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The :data:`Gather` of tensors every process holds whole."""
    yield [t.data for t in tensors]


def sync_tensors(module: nn.Module, *, lora: bool) -> list[torch.Tensor]:
    """What a version of ``module`` sends, in order: a LoRA policy's trainable (adapter) parameters only (the
    generator loads the same frozen base itself, :func:`check_base`); else every parameter and buffer. Taken on a
    generator before it freezes its copy."""
    if lora:
        return [p for p in module.parameters() if p.requires_grad]
    return [*module.parameters(), *module.buffers()]


def frozen_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A LoRA policy's frozen base parameters (what :func:`check_base` compares)."""
    return [p for p in module.parameters() if not p.requires_grad]


def _wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor travels in: fp32 for bf16 / fp16 (exact; a DeepSpeed bf16 module and the generator's fp32
    copy then agree on it), else its own."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _numel(t: torch.Tensor) -> int:
    """The full size of a tensor (a ZeRO-3 parameter holds only its partition: ``ds_numel``)."""
    return int(getattr(t, "ds_numel", 0) or t.numel())


def _buckets(tensors: list[torch.Tensor]) -> Iterable[list[int]]:
    """Indices of ``tensors`` in runs of one wire dtype of at most :data:`BUCKET_BYTES` (a larger tensor alone);
    the same on both sides from the full sizes."""
    run: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = _numel(t) * _wire_dtype(t).itemsize
        if run and (_wire_dtype(t) != _wire_dtype(tensors[run[0]]) or size + nbytes > BUCKET_BYTES):
            yield run
            run, size = [], 0
        run.append(i)
        size += nbytes
    if run:
        yield run


def _wire_device(tensors: list[torch.Tensor], group: Any) -> torch.device:
    if not tensors or dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return tensors[0].device


def _full_buckets(tensors: list[torch.Tensor], gather: Gather, device: torch.device,
                  keep: bool) -> Iterator[torch.Tensor | None]:
    """Each bucket of ``tensors`` gathered whole (every trainer takes part in the gather) and flattened in its wire
    dtype on ``device`` where ``keep`` (trainer rank 0), else None: one bucket at a time beside the shards."""
    with torch.no_grad():
        for idx in _buckets(tensors):
            with gather([tensors[i] for i in idx]) as full:
                yield torch.cat([f.reshape(-1).to(device, _wire_dtype(f)) for f in full]) if keep else None


def push_weights(tensors: list[torch.Tensor], placement: Placement, gather: Gather = as_is) -> int:
    """Every trainer: send ``tensors`` (:func:`sync_tensors` of the trained module, sharded or whole) to every
    generator (they call :func:`pull_weights`), gathered bucket by bucket over the trainers' group and broadcast
    from trainer rank 0 alone; the bytes it sent (0 on the other trainers)."""
    sender, sent = placement.env.rank == 0, 0
    device = _wire_device(tensors, placement.sync) if sender else torch.device("cpu")  # only rank 0 is in sync
    for flat in _full_buckets(tensors, gather, device, sender):
        if flat is not None:
            dist.broadcast(flat, group=placement.sync, group_src=0)
            sent += flat.numel() * flat.element_size()
    return sent


def pull_weights(tensors: list[torch.Tensor], placement: Placement) -> None:
    """A generator: receive trainer rank 0's next :func:`push_weights` into ``tensors`` (its own copy's)."""
    device = _wire_device(tensors, placement.sync)
    with torch.no_grad():
        for idx in _buckets(tensors):
            flat = torch.empty(sum(_numel(tensors[i]) for i in idx), dtype=_wire_dtype(tensors[idx[0]]), device=device)
            dist.broadcast(flat, group=placement.sync, group_src=0)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].data.copy_(flat[offset : offset + n].view_as(tensors[i]))
                offset += n


def check_base(tensors: list[torch.Tensor], placement: Placement, gather: Gather = as_is) -> None:
    """Once at start, every process of a LoRA run: the frozen base ``tensors`` (:func:`frozen_tensors`) of trainer
    rank 0 and of each generator must be equal (a SHA-256 of their bytes, gathered bucket by bucket like
    :func:`push_weights`), since only the adapters travel; one line otherwise, on each of them."""
    keep = placement.role == "generator" or placement.env.rank == 0
    digest = hashlib.sha256()
    for flat in _full_buckets(tensors, gather, torch.device("cpu"), keep):
        if flat is not None:
            digest.update(flat.numpy().tobytes())
    if not keep:
        return
    mine = (digest.hexdigest(), len(tensors))
    every: list[Any] = [None] * dist.get_world_size(placement.sync)
    dist.all_gather_object(every, mine, group=placement.sync)
    if any(d != every[0] for d in every):
        raise ConfigError(f"rollout.placement: separate with LoRA: the generators' base weights differ from the "
                          f"trainers' (checksums {sorted({d[0][:12] for d in every})}); only the adapters are sent, "
                          "so every process must load the same model.name_or_path")


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
