"""Masked reductions over token positions (``values`` and ``response_mask`` of the same shape).

The mask is read as 0/1: any non-zero (or ``True``) entry counts, weights are not supported.
Masked-out entries are dropped with ``torch.where``, not multiplied by 0, so a ``-inf``/``nan`` at a
padded position (e.g. the log-prob of a pad token) cannot poison the sum or its gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

DimArg = int | tuple[int, ...] | None


def _keep(values: Tensor, mask: Tensor) -> Tensor:
    keep = mask if mask.dtype == torch.bool else mask != 0
    return torch.broadcast_to(keep, torch.broadcast_shapes(values.shape, keep.shape))


def masked_sum(values: Tensor, mask: Tensor, dim: DimArg = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Args:
        values: ``(..., T)`` any float tensor.
        mask: broadcastable to ``values``; bool or 0/1.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.
    """
    keep = _keep(values, mask)
    kept = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: DimArg = None, eps: float = 1e-8) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

    The count is clamped below at ``eps`` (not shifted by it), so the mean is exact whenever at
    least one position is set, and an all-masked row gives 0 rather than ``nan``.
    """
    keep = _keep(values, mask)
    total = masked_sum(values, keep, dim)
    count = keep.sum() if dim is None else keep.sum(dim)
    return total / count.to(total.dtype).clamp_min(eps)
