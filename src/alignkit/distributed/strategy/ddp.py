"""DistributedDataParallel: every rank holds the whole model, gradients are all-reduced."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from alignkit.distributed.strategy.base import OptimizerFactory, Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = model.to(self.device)
        if self.env.world_size > 1:
            o = self.cfg.ddp
            model = DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=o.find_unused_parameters,
                bucket_cap_mb=o.bucket_cap_mb,
                gradient_as_bucket_view=o.gradient_as_bucket_view,
                broadcast_buffers=o.broadcast_buffers,
                static_graph=o.static_graph,
            )
        return model, make_optimizer(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()
