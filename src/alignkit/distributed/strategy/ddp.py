"""DistributedDataParallel: every rank holds the whole model, gradients are all-reduced."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
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
        return Handle(role, model, make_optimizer(model))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def no_sync(self, handle: Handle) -> Iterator[None]:
        with super().no_sync(handle):
            if isinstance(handle.module, DistributedDataParallel):
                with handle.module.no_sync():
                    yield
            else:
                yield
