"""Strategies by name; ``auto`` resolves from the launcher environment."""

from __future__ import annotations

from alignkit.config.schema import RunConfig
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy.base import Strategy
from alignkit.distributed.strategy.ddp import DDPStrategy
from alignkit.distributed.strategy.single import SingleStrategy
from alignkit.registry import Registry

STRATEGIES: Registry[type[Strategy]] = Registry("distributed.strategy")
STRATEGIES.register("single")(SingleStrategy)
STRATEGIES.register("ddp")(DDPStrategy)


def resolve_strategy_name(cfg: RunConfig, env: DistEnv) -> tuple[str, str]:
    """The concrete strategy for ``cfg`` and a one-line reason (printed at start-up)."""
    name = cfg.distributed.strategy
    if name != "auto":
        return name, "set in the config"
    if env.world_size > 1:
        return "ddp", f"auto: {env.world_size} processes under a launcher"
    return "single", "auto: one process"


def build_strategy(cfg: RunConfig, env: DistEnv) -> Strategy:
    name, _ = resolve_strategy_name(cfg, env)
    return STRATEGIES.get(name)(cfg.distributed, env, cfg.model.dtype)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "resolve_strategy_name"]
