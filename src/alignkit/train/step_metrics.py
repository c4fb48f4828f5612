"""What an optimizer step leaves for the logs and the hooks, kept off the host until asked for.

:class:`StepResult` holds the step's global loss and gradient norms (the step's one read-back) and this rank's
metric sums, still on the device; :class:`Window` gathers steps until a log line, which reduces their sums
over ranks and reads them back once; :class:`LazyMetrics` reduces a step's metrics only if a hook reads them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from alignkit.distributed import comm
from alignkit.distributed.comm import stack_on_one_device
from alignkit.distributed.strategy.base import Strategy
from alignkit.logging import peak_memory_mb
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models


@dataclass
class StepResult:
    """One optimizer step. The loss and the gradient norms are global and on the host (the step's one
    read-back); the metric sums and the token count are this rank's, left where they were computed until
    something asks for the global ones (:meth:`reduced`: a log line, a hook that reads metrics)."""

    loss: float  # the trainable (primary) role's loss, mean over ranks
    local_sums: MetricSums
    local_tokens: float
    grad_norms: dict[str, float]
    nonfinite: bool = False  # the update was dropped: a loss or gradient norm was not finite
    role_losses: dict[str, float] = field(default_factory=dict)  # further roles' losses, mean over ranks
    _global: tuple[MetricSums, float] | None = field(default=None, repr=False)

    def reduced(self) -> tuple[MetricSums, float]:
        """(global metric sums, global tokens): one all-reduce the first time; every rank must call it."""
        if self._global is None:
            self._global = reduce_sums(self.local_sums, self.local_tokens)
            for role, value in self.role_losses.items():
                self._global[0].add(f"loss/{role}", value, 1)
        return self._global

    @property
    def sums(self) -> MetricSums:
        return self.reduced()[0]

    @property
    def tokens(self) -> float:
        return self.reduced()[1]

    @property
    def metrics(self) -> dict[str, float]:
        return {"loss": self.loss, **self.sums.means()}


class LazyMetrics(Mapping[str, float]):
    """A step's global metrics, reduced (one all-reduce and one read-back) only when a hook reads them: an
    offline step stays free of host syncs unless the algorithm asks. Every rank runs the same hook, so
    every rank reads (and reduces) alike."""

    def __init__(self, result: StepResult) -> None:
        self._result = result
        self._values: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._values is None:
            self._values = self._result.metrics
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def reduce_sums(sums: MetricSums, tokens: float) -> tuple[MetricSums, float]:
    """Every rank's metric sums and counts and token count, summed in one all-reduce (values stay on the
    device they were computed on)."""
    names = sorted(sums.sums)
    flat = comm.all_reduce_sum(stack_on_one_device(
        [torch.tensor(float(tokens), dtype=torch.float64)] + [sums.sums[n] for n in names]
        + [sums.counts[n] for n in names]))
    total, k = MetricSums(), len(names)
    for i, n in enumerate(names):
        total.add(n, flat[1 + i], flat[1 + k + i])
    return total, flat[0]


def step_result(strategy: Strategy, models: Models, role_sums: dict[str, float], sums: MetricSums, tokens: int,
                grad_norms: dict[str, float], nonfinite: bool = False) -> StepResult:
    """The step's result from its read-back: global losses (mean over ranks) and norms; local metric sums."""
    roles = list(models.handles)
    mean = {r: role_sums.get(r, 0.0) / strategy.dp_size for r in roles}
    return StepResult(mean[roles[0]], sums, float(tokens), grad_norms, nonfinite, {r: mean[r] for r in roles[1:]})


class Window:
    """Metrics accumulated between two log lines: losses on the host, metric sums and tokens where they
    were computed (reduced over ranks once, at the log line)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.local, self.local_tokens = MetricSums(), 0.0  # this rank's: reduced at the log line
        self.sums = MetricSums()  # already global (identical on every rank): not reduced again
        self.start = time.perf_counter()

    def add(self, result: StepResult) -> None:
        self.losses.append(result.loss)
        self.local.merge(result.local_sums)
        self.local_tokens += result.local_tokens
        for role, value in result.role_losses.items():
            self.sums.add(f"loss/{role}", value, 1)

    def metrics(self, strategy: Strategy) -> dict[str, float]:
        """Mean loss, tokens/s, peak memory (max over ranks) and the metric means of the window."""
        sums, tokens = reduce_sums(self.local, self.local_tokens)
        sums.merge(self.sums)
        mem = comm.all_reduce_max(torch.tensor(peak_memory_mb(strategy.device.type), dtype=torch.float64,
                                                device=strategy.device))
        sums.add(" tokens", tokens, 1)  # read back with the metrics: one transfer for the whole log line
        sums.add(" peak_mem_mb", mem, 1)
        means = sums.means()
        tokens, mem = means.pop(" tokens"), means.pop(" peak_mem_mb")
        # timed after the read-back: the window's device work has finished, none of it falls into the next window
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        # a throughput of no tokens (flow_grpo trains on images) is no metric: not logged rather than 0
        throughput = {"tokens_per_s": tokens / elapsed} if tokens else {}
        means = {k: v for k, v in means.items() if not (k.endswith("tokens_per_s") and v == 0.0)}
        return {"loss": sum(self.losses) / max(1, len(self.losses)), **throughput, "peak_mem_mb": mem, **means}
