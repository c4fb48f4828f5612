"""DDP's gradient reduction overlapping the backward, for bf16 compute weights (``model.compute_weights: cast``).

Under cast the forward and backward run a bf16 copy of the model that DDP does not wrap (DDP would reduce in bf16
and into the copy, not the fp32 masters the optimizer steps). Reducing every master gradient after the backward
leaves the network idle while the backward runs and the GPU idle while the network runs. This reducer restores
the overlap the way DDP's own buckets do, keeping FSDP2's ``reduce_dtype=fp32``:

* the compute parameters are grouped into buckets of ``distributed.ddp.bucket_cap_mb`` (counted in fp32 bytes) in
  REVERSE parameter order, the order a decoder's backward produces gradients (DDP's heuristic);
* on the last micro-batch of a step (``Handle.sync``), a post-accumulate-grad hook on each compute parameter marks
  it ready; when a bucket is complete its bf16 gradients are added into the fp32 master gradients and the bucket's
  fp32 gradients are flattened and all-reduced asynchronously, while the backward goes on;
* buckets start strictly in bucket order (a complete bucket waits for the ones before it), so every rank issues
  the same collectives in the same order whatever its timing; a bucket holding a parameter this rank did not use
  starts after the backward (:meth:`CastReducer.finish`), with zeros for that gradient;
* :meth:`CastReducer.finish` (before clipping and the optimizer) starts what is left, waits for every bucket and
  writes ``sum / ranks`` back into the master gradients.

The accumulation micro-batches (``no_sync``) are untouched: their bf16 gradients go into the fp32 masters after
each backward (``compute_weights.accumulate_grads``), so accumulation stays in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from alignkit.distributed.strategy import compute_weights as cw
from alignkit.models.handle import Handle


def plan_buckets(sizes: list[int], cap_bytes: float) -> list[list[int]]:
    """Parameter indices grouped into buckets of at most ``cap_bytes`` (a bigger parameter gets its own), in
    reverse order: ``sizes[i]`` is parameter i's bytes. The last parameter is in the first bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(sizes))):
        if current and held + sizes[i] > cap_bytes:
            buckets.append(current)
            current, held = [], 0
        current.append(i)
        held += sizes[i]
    if current:
        buckets.append(current)
    return buckets


class CastReducer:
    """The overlapped fp32 reduction of one handle's master gradients over ``group`` (None: the whole world).
    ``trace``: set it to a list to record ``("launch", bucket)`` as buckets start (tests)."""

    def __init__(self, handle: Handle, bucket_cap_mb: float, group: Any = None) -> None:
        self.handle = handle
        self.group = group
        self.masters, self.computes = cw.pairs(handle)
        self.buckets = plan_buckets([p.numel() * 4 for p in self.masters], bucket_cap_mb * 1024 * 1024)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.trace: list[tuple[str, int]] | None = None
        self._reset()
        for i, p in enumerate(self.computes):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))

    def _reset(self) -> None:
        self.ready: list[set[int]] = [set() for _ in self.buckets]
        self.next = 0  # the next bucket to start
        self.works: list[tuple[Any, torch.Tensor]] = []

    def _ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is accumulated: start every complete bucket, in bucket order."""
        if not self.handle.sync:
            return  # an accumulation micro-batch: the masters take its gradients after the backward
        b = self.bucket_of[i]
        if b < self.next:
            raise RuntimeError(f"{self.handle.role}: a parameter got a second gradient in one backward after its "
                               "bucket was reduced (a weight reused across separate graph regions); set "
                               "model.compute_weights: autocast for this model")
        self.ready[b].add(i)
        while self.next < len(self.buckets) and len(self.ready[self.next]) == len(self.buckets[self.next]):
            self._launch(self.next)

    def _launch(self, b: int) -> None:
        """Bucket ``b``: master.grad += compute.grad (fp32), then an async all-reduce of its fp32 gradients."""
        masters = [self.masters[i] for i in self.buckets[b]]
        for m, c in zip(masters, [self.computes[i] for i in self.buckets[b]]):
            g = c.grad
            if g is None:
                if m.grad is None:  # unused here; another rank may have used it: every rank sends all
                    m.grad = torch.zeros_like(m)
            elif m.grad is None:
                m.grad = g.float()
            else:
                m.grad.add_(g)
            c.grad = None
        flat = _flatten_dense_tensors([m.grad for m in masters])
        self.works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat))
        self.next = b + 1
        if self.trace is not None:
            self.trace.append(("launch", b))

    def finish(self) -> None:
        """Start the buckets not yet started, wait for all of them and write the average into the masters."""
        while self.next < len(self.buckets):
            self._launch(self.next)
        ranks = dist.get_world_size(self.group)
        for (work, flat), idx in zip(self.works, self.buckets):
            work.wait()
            flat.div_(ranks)
            grads = [self.masters[i].grad for i in idx]
            torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))
        self._reset()
