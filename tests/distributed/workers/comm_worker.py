"""Run under torchrun with 2 processes: metric reduction and eval sharding agree on every rank."""

import os
import sys

import torch
import torch.distributed as dist

from alignkit.data.sampler import EvalSampler
from alignkit.distributed import comm
from alignkit.metrics import MetricSums

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# rank 0 holds values [1, 2], rank 1 holds [3, 4, 5]: the global mean is 3, not mean-of-means 2.75
local = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, 4.0, 5.0])
m = MetricSums()
m.add_mean("x", local)
reduced = comm.reduce_metrics(m.sums, m.counts)
everyone = comm.all_gather_object(reduced)
assert all(r == everyone[0] for r in everyone), everyone
assert abs(reduced["x"] - 3.0) < 1e-12, reduced

# a statistic steering training is broadcast, so every rank holds rank 0's value exactly
lam = comm.broadcast_tensor(torch.tensor([0.5 + rank]))
assert comm.all_gather_object(lam.item()) == [0.5, 0.5]

# evaluation: 7 examples on 2 ranks -> every example exactly once, no padding duplicates
seen = comm.all_gather_object(list(EvalSampler(7, world, rank)))
assert sorted(i for part in seen for i in part) == list(range(7)), seen

print(f"comm checks passed on rank {rank}", flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
