"""Samplers: the resumable global training order and an exact-once evaluation sampler."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from alignkit.errors import DataError


class GlobalOrder:
    """The training order: one seeded permutation per epoch, read as ONE global sequence.

    Each micro-batch round takes the next ``world x per_device`` examples of the epoch's order, rank
    r taking its contiguous share; the position saved with a checkpoint is the number of examples of
    the epoch consumed by all ranks together. A resume at another world size or per-device batch
    therefore continues on exactly the examples not seen yet (no repeats, no skips). The epoch's
    usable length is ``(n // world) x world``: the tail that cannot be split evenly is dropped, so no
    example is seen twice in an epoch (at most ``world - 1`` are left out, different ones each epoch).
    """

    def __init__(self, n: int, world: int, rank: int, per_device: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if n == 0:
            raise DataError("the training set has no examples")
        if n < world:
            raise DataError(f"the data set has {n} examples, fewer than the {world} processes")
        self.n, self.world, self.rank, self.per_device = n, world, rank, per_device
        self.shuffle, self.seed = shuffle, seed

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's usable order (all ranks): positions into the data set, 8 bytes each (a Python
        list would cost ~36 bytes an example on every rank)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).numpy()
        else:
            order = np.arange(self.n, dtype=np.int64)
        return order[: (self.n // self.world) * self.world]

    def rounds(self, epoch: int, consumed: int = 0) -> Iterator[tuple[list[int], int]]:
        """(this rank's indices for the next micro-batch, examples consumed after that round) from
        position ``consumed`` to the end of the epoch; every rank gets the same number of rounds."""
        order = self.order(epoch)
        while True:
            share = min(self.per_device, (len(order) - consumed) // self.world)
            if share <= 0:
                return
            start = consumed + self.rank * share
            consumed += share * self.world
            yield order[start : start + share].tolist(), consumed

    def usable(self) -> int:
        return (self.n // self.world) * self.world


class EvalSampler(Sampler[int]):
    """Rank r evaluates examples r, r+W, r+2W, ...: every example exactly once, no padding
    (unlike DistributedSampler, which repeats up to W-1 examples and biases metrics)."""

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.idx = range(rank, n, num_replicas)  # not a list: no memory per example

    def __iter__(self) -> Iterator[int]:
        return iter(self.idx)

    def __len__(self) -> int:
        return len(self.idx)
