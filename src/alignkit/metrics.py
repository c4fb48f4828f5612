"""The metrics a step reports: sums and counts per metric name, kept on the device until a log line.

Below the rollout and the algorithms (both add to one) and the training loops (which reduce them across
ranks, ``train/step_metrics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from alignkit.distributed.comm import stack_on_one_device


@dataclass
class MetricSums:
    """Metric sums and counts of one micro-batch, reduced across ranks at the end of a log window.

    Values stay where they were computed (the device in a training step): adding a metric never waits
    for the device; only :meth:`means` (at a log line) reads them back to the host."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        total, count = _f64(total), _f64(count)
        if name in self.sums:  # a 0-d CPU value adds to a device value without a copy back
            total, count = self.sums[name] + total, self.counts[name] + count
        self.sums[name], self.counts[name] = total, count

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """Add every element of ``values`` as one sample of ``name``."""
        self.add(name, values.detach().double().sum(), values.numel())

    def add_masked_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Add the elements of ``values`` where ``mask`` is non-zero as samples of ``name``."""
        keep = mask.detach().double()
        self.add(name, (values.detach().double() * keep).sum(), keep.sum())

    def merge(self, other: "MetricSums") -> None:
        for k in other.sums:
            self.add(k, other.sums[k], other.counts[k])

    def means(self) -> dict[str, float]:
        """sum / count of each metric (NaN where nothing was counted); no reduction across ranks. Reads
        every value back to the host in one transfer."""
        names = list(self.sums)
        host = stack_on_one_device([v for n in names for v in (self.sums[n], self.counts[n])]).tolist()
        return {n: host[2 * i] / host[2 * i + 1] if host[2 * i + 1] > 0 else float("nan") for i, n in enumerate(names)}


def _f64(value: torch.Tensor | float) -> torch.Tensor:
    """A detached float64 0-d tensor on the value's own device (a Python number: exact, on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.tensor(value, dtype=torch.float64)
