"""Worker (3 processes: 2 trainers + 1 generator, ``placement.split_world``): the weight path of a separate placement.

1. Two FSDP2 trainers hold a model sharded over the trainers' group; ``push_weights`` with 16-byte buckets (so every
   tensor is a bucket of its own or more) and ``FSDPStrategy.gathered`` sends it whole to the generator, whose copy
   started from other weights: afterwards every tensor equals the trainers' unsharded model (built from the same
   seed here), and trainer rank 0 reports the bytes (4 per number), trainer 1 reports 0.
2. ``check_base``: equal bases pass; a generator base that differs in one number is refused on every process of
   the weight-sync group with the one-line ConfigError.
Prints ``OK <rank> <bytes>`` at the end of each process.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from alignkit.distributed import comm, placement
from alignkit.errors import ConfigError


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Sequential(nn.Linear(5, 3)), nn.LayerNorm(3))


def main() -> None:
    where = placement.split_world(1, "gloo", torch.device("cpu"))
    placement.BUCKET_BYTES = 16
    reference, sent = model(0), 0
    if where.role == "trainer":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from alignkit.distributed.strategy.fsdp import FSDPStrategy

        sharded = copy.deepcopy(reference)
        mesh = DeviceMesh.from_group(comm.group(), "cpu", mesh_dim_names=("dp",))
        fully_shard(sharded[1], mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        def gather(tensors: list[torch.Tensor]):  # FSDPStrategy.gathered needs no state of its own
            return FSDPStrategy.gathered(None, tensors)  # type: ignore[arg-type]

        sent = placement.push_weights(placement.sync_tensors(sharded, lora=False), where, gather)
        assert sent == (4 * sum(p.numel() for p in reference.parameters()) if where.env.rank == 0 else 0), sent
        base = [p.detach() for p in reference.parameters()]
    else:
        mine = model(1)
        placement.pull_weights(placement.sync_tensors(mine, lora=False), where)
        for a, b in zip(mine.state_dict().values(), reference.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        base = [p.detach().clone() for p in reference.parameters()]
    placement.check_base(base, where)  # the same base everywhere: passes
    if where.role == "generator":
        base[2][0, 0] += 1e-3
    try:
        placement.check_base(base, where)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    # refused on trainer rank 0 and the generator (the weight-sync group); trainer 1 only helps gather
    assert ("base weights differ" in refused) == (where.env.rank in (0, 2)), (where.env.rank, refused)
    print(f"OK {where.env.rank} {sent}", flush=True)  # one write: three processes share the pipe


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
