"""Samplers: a resumable sharded training sampler and an exact-once evaluation sampler."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from alignkit.errors import DataError


class ShardedSampler(Sampler[int]):
    """DistributedSampler semantics (one seeded permutation per epoch, rank r takes every
    W-th index starting at r) without padding: the tail that does not fill all ranks equally
    is dropped, so no example is seen twice in an epoch. ``start`` skips the first examples of
    this rank's shard, which is how a resumed run continues mid-epoch without reading them.
    """

    def __init__(self, n: int, num_replicas: int, rank: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if n < num_replicas:
            raise DataError(f"the data set has {n} examples, fewer than the {num_replicas} processes")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.start = 0
        self.per_rank = n // num_replicas

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        order = order[: self.per_rank * self.num_replicas]
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return self.per_rank - self.start


class EvalSampler(Sampler[int]):
    """Rank r evaluates examples r, r+W, r+2W, ...: every example exactly once, no padding
    (unlike DistributedSampler, which repeats up to W-1 examples and biases metrics)."""

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.idx = list(range(rank, n, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.idx)

    def __len__(self) -> int:
        return len(self.idx)
