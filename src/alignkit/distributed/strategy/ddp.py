"""DistributedDataParallel: every rank holds the whole model, gradients are all-reduced."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy
from alignkit.distributed.strategy.cast_reduce import CastReducer


def buffer_sync(every_forward: bool) -> dict[str, bool]:
    """DDP's buffer broadcast before each forward. torch 2.13 renamed ``broadcast_buffers`` to
    ``forward_sync_buffers`` and warns (FutureWarning, every rank) on the old name. The new one
    still syncs buffers once at construction, which changes nothing here: every rank builds the
    same model, whose buffers (e.g. rotary inv_freq) are identical."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": every_forward}


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the overlapped fp32 reduction of each role trained with bf16 compute weights (cast_reduce.py)
        self.reducers: dict[str, CastReducer] = {}

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
        handle = self.place(model, make_optimizer, role, self._wrap if self.env.world_size > 1 else lambda m: m)
        if handle.master is not None and self.env.world_size > 1:
            self.reducers[role] = CastReducer(handle, self.cfg.ddp.bucket_cap_mb, comm.group())
        return handle

    def _wrap(self, model: nn.Module) -> nn.Module:
        o = self.cfg.ddp
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=o.find_unused_parameters,
            bucket_cap_mb=o.bucket_cap_mb,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            static_graph=o.static_graph,
            **buffer_sync(o.broadcast_buffers),
            process_group=comm.group(),  # the trainers' group under rollout.placement: separate
        )

    def sync_masters(self, master: nn.Module) -> None:
        if self.env.world_size > 1:
            params = [p.detach() for p in master.parameters()]
            flat = _flatten_dense_tensors(params)
            dist.broadcast(flat, src=0, group=comm.group())  # global rank 0 is trainer 0 under any placement
            torch._foreach_copy_(params, list(_unflatten_dense_tensors(flat, params)))

    def reduce_master_grads(self, handle: Handle) -> None:
        """The fp32 master gradients averaged over the ranks (``reduce_dtype=fp32``): the buckets the backward of
        the step's last micro-batch started as their gradients became ready (overlapping it, as DDP's buckets do)
        are waited for here, the rest are started and waited for (:class:`CastReducer`)."""
        if self.env.world_size > 1 and handle.master is not None:
            self.reducers[handle.role].finish()

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
