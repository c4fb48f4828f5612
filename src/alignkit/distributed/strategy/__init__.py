"""Strategies by name; ``auto`` resolves from the launcher environment and the memory estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignkit.config.schema import DistributedConfig, RunConfig
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy.base import Handle, Strategy
from alignkit.distributed.strategy.ddp import DDPStrategy
from alignkit.distributed.strategy.deepspeed import DeepSpeedStrategy
from alignkit.distributed.strategy.fsdp import FSDPStrategy
from alignkit.distributed.strategy.single import SingleStrategy
from alignkit.planner.auto import auto_strategy
from alignkit.registry import Registry

if TYPE_CHECKING:
    from alignkit.models.roles import Workload
    from alignkit.planner.auto import DeviceMemory

STRATEGIES: Registry[type[Strategy]] = Registry("distributed.strategy")
STRATEGIES.register("single")(SingleStrategy)
STRATEGIES.register("ddp")(DDPStrategy)
STRATEGIES.register("fsdp")(FSDPStrategy)
STRATEGIES.register("deepspeed")(DeepSpeedStrategy)  # imports deepspeed only in setup()


def resolve_strategy(cfg: RunConfig, env: DistEnv, workload: Workload, memory: DeviceMemory | None = None,
                     ) -> tuple[str, str, DistributedConfig]:
    """The one place that decides: (strategy name, one-line reason, the ``distributed`` settings to use).

    ``auto`` in one process is ``single``; under several it compares the memory estimate of the
    run's models (``workload``: the algorithm's model specs) with
    the device memory (``memory``, probed when None): ddp if it fits, else ZeRO-2-like, else
    ZeRO-3-like (DeepSpeed stage 2/3 where importable on GPUs, else FSDP2 without/with resharding).
    """
    name = cfg.distributed.strategy
    if name != "auto":
        return name, "set in the config", cfg.distributed
    if env.world_size > 1:
        return auto_strategy(cfg, env, workload, memory)
    return "single", "auto: one process", cfg.distributed


def build_strategy(name: str, dist: DistributedConfig, env: DistEnv, dtype: str = "auto", *,
                   auto_picked: bool = False, compute_weights: str = "cast") -> Strategy:
    """The registered engine ``name`` with its resolved ``distributed`` settings (from :func:`resolve_strategy`)
    and ``model.dtype`` / ``model.compute_weights``."""
    return STRATEGIES.get(name)(dist, env, dtype, auto_picked=auto_picked, compute_weights=compute_weights)


__all__ = ["STRATEGIES", "Handle", "Strategy", "build_strategy", "resolve_strategy"]
