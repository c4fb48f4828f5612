"""The run plan: strategy (and why), batch arithmetic, learning rate and step counts, computed once
by the runner (or ``alignkit validate``) and passed down; nothing downstream recomputes them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from alignkit.config import BatchPlan, RunConfig, resolve_batch, scaled_learning_rate
from alignkit.config.schema import DistributedConfig, TrainingConfig
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy import resolve_strategy
from alignkit.errors import DataError
from alignkit.models.roles import Workload

if TYPE_CHECKING:
    from alignkit.planner.auto import DeviceMemory


@dataclass(frozen=True)
class StepPlan:
    """Micro-batches per epoch per rank, optimizer steps per epoch, optimizer steps in all."""

    micro_per_epoch: int
    per_epoch: int
    total: int


@dataclass(frozen=True)
class RunPlan:
    strategy: str
    reason: str
    distributed: DistributedConfig
    batch: BatchPlan
    lr: float
    steps: StepPlan | None = None  # known once the training set is built (:meth:`with_steps`)

    @property
    def auto_picked(self) -> bool:
        return self.reason.startswith("auto")

    def with_steps(self, n_examples: int, t: TrainingConfig) -> RunPlan:
        return dataclasses.replace(self, steps=plan_steps(n_examples, self.batch.per_device, self.batch.accumulation,
                                                          self.batch.world_size, t))


def plan_steps(n_examples: int, per_device: int, accumulation: int, world: int, t: TrainingConfig) -> StepPlan:
    """Steps of a run over ``n_examples`` (every rank gets ``n // world``; the tail is dropped)."""
    per_rank = n_examples // world
    if per_rank == 0:
        raise DataError(f"the training set has {n_examples} examples, fewer than the {world} processes")
    micro = math.ceil(per_rank / per_device)
    per_epoch = math.ceil(micro / accumulation)
    total = t.max_steps if t.max_steps is not None else max(1, math.ceil(per_epoch * t.epochs))
    return StepPlan(micro, per_epoch, total)


def plan_run(cfg: RunConfig, env: DistEnv, workload: Workload, memory: DeviceMemory | None = None) -> RunPlan:
    """Strategy (``auto`` sized from the workload's model specs against ``memory``, probed when None),
    batch plan and learning rate."""
    name, why, dist = resolve_strategy(cfg, env, workload, memory)
    batch = resolve_batch(cfg, env.world_size)
    return RunPlan(name, why, dist, batch, scaled_learning_rate(cfg, batch))
