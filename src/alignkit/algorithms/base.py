"""What an offline algorithm supplies to the shared loop: the models it needs, its data pipeline and
the per-batch math.

An algorithm declares its models as roles (:meth:`OfflineAlgorithm.model_specs`), gets them back
as a :class:`~alignkit.models.roles.Models` bundle, and has a data pipeline (``self.data``: rows ->
examples -> micro-batches, and how many loss units a micro-batch holds) by composition. Its
``loss`` returns the loss of the trainable role (or a dict role -> loss when several roles train);
accumulation, normalisation, stepping, logging and checkpoints are the loop's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from alignkit.config.schema import RunConfig
from alignkit.models.roles import ModelSpec, Models

if TYPE_CHECKING:
    from alignkit.data.io import RowCounts
    from alignkit.distributed.strategy.base import Strategy

Batch = dict[str, torch.Tensor]
Example = dict[str, Any]


@dataclass
class MetricSums:
    """Metric sums and counts of one micro-batch, reduced across ranks once per optimizer step."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        total = torch.as_tensor(total, dtype=torch.float64).detach().cpu()
        count = torch.as_tensor(count, dtype=torch.float64).detach().cpu()
        self.sums[name] = self.sums.get(name, torch.zeros((), dtype=torch.float64)) + total
        self.counts[name] = self.counts.get(name, torch.zeros((), dtype=torch.float64)) + count

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """Add every element of ``values`` as one sample of ``name``."""
        self.add(name, values.detach().double().sum(), values.numel())

    def merge(self, other: "MetricSums") -> None:
        for k in other.sums:
            self.add(k, other.sums[k], other.counts[k])

    def means(self) -> dict[str, float]:
        """sum / count of each metric (NaN where nothing was counted); no reduction across ranks."""
        return {k: float(total) / float(self.counts[k]) if float(self.counts[k]) > 0 else float("nan")
                for k, total in self.sums.items()}


class DataPipeline(Protocol):
    """Rows -> examples -> micro-batches for one algorithm (``data/`` supplies the implementations)."""

    #: rows dropped per split ("train" / "eval"): skipped by ``data.skip_invalid`` or with nothing to learn
    skipped: dict[str, int]
    #: per split, the rows dropped or changed (e.g. truncated) by cause, for the start-up log
    row_counts: dict[str, RowCounts]

    def build_dataset(self, specs: list[str], split: str) -> list[Example]:
        """Tokenized examples of the files in ``specs`` (``split`` is 'train' or 'eval')."""

    def collate(self, examples: list[Example]) -> Batch:
        """A micro-batch of tensors from a list of examples."""

    def loss_units(self, batch: Batch) -> int:
        """How many loss units (tokens or sequences) this micro-batch holds."""

    def tokens_in(self, batch: Batch) -> int:
        """Non-pad tokens processed (for tokens/s)."""


class OfflineAlgorithm(ABC):
    """One algorithm of the offline loop (SFT, reward/cost models, the DPO family, ...)."""

    name: str = "base"
    #: "tokens" for token-level losses, "sequences" for per-example losses (ALGORITHMS 6.1).
    loss_unit: str = "tokens"
    #: sequences one example puts through the trainable model (2 for a chosen/rejected pair)
    sequences_per_example: int = 1
    #: metrics the console step line shows first, after a 1-based "Epoch E step N" (seed-guide lines)
    console_keys: tuple[str, ...] = ()
    #: log the estimator's per-component memory table at start-up (runs holding several models)
    memory_table: bool = False

    def __init__(self, cfg: RunConfig, tokenizer: Any, data: DataPipeline) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.data = data

    @classmethod
    @abstractmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        """The models this run needs, trainable ones first (the first is the run's ``final/``)."""

    @abstractmethod
    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor | dict[str, torch.Tensor], MetricSums]:
        """Loss of one micro-batch, already divided by ``normalizer`` (global units / dp_size): one
        tensor for the trainable role, or ``{role: loss}`` when several roles train."""

    @abstractmethod
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        """Evaluation metric sums of one micro-batch (no grad)."""

    def before_training(self, models: Models, train_set: list[Example], eval_set: list[Example],
                        strategy: Strategy) -> None:
        """Called once, after the models are built and placed, before the first step (and before a
        resume restores weights). E.g. DPO caches reference log-probs in the examples."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Hook after each optimizer step with that step's metrics reduced over every rank and
        micro-batch (e.g. a dual update); returns extra metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state that a checkpoint must carry (e.g. a Lagrange multiplier)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
