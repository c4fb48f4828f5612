"""One process on one device (a GPU if present, else the CPU)."""

from __future__ import annotations

from torch import nn

from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy
from alignkit.errors import ConfigError


class SingleStrategy(Strategy):
    name = "single"

    def setup(self) -> None:
        if self.env.world_size > 1:
            raise ConfigError(
                f"distributed.strategy=single but the launcher started {self.env.world_size} processes; "
                "use distributed.strategy=ddp (or auto)"
            )

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
        return self.place(model, make_optimizer, role)
