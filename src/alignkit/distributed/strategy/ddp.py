"""DistributedDataParallel: every rank holds the whole model, gradients are all-reduced."""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy


def buffer_sync(every_forward: bool) -> dict[str, bool]:
    """DDP's buffer broadcast before each forward. torch 2.13 renamed ``broadcast_buffers`` to
    ``forward_sync_buffers`` and warns (FutureWarning, every rank) on the old name. The new one
    still syncs buffers once at construction, which changes nothing here: every rank builds the
    same model, whose buffers (e.g. rotary inv_freq) are identical."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": every_forward}


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
                static_graph=o.static_graph,
                **buffer_sync(o.broadcast_buffers),
                process_group=comm.group(),  # the trainers' group under rollout.placement: separate
            )
        return Handle(role, model, make_optimizer(model), scaler=self.new_scaler())

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
