"""What an offline algorithm supplies to the shared loop: data, models and per-batch math."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from alignkit.config.schema import RunConfig
from alignkit.data.preference import PairCollator, count_pairs, load_pairs


@dataclass
class MetricSums:
    """Metric sums and counts of one micro-batch, reduced across ranks only at logging time."""

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


class OfflineAlgorithm(ABC):
    """One algorithm of the offline loop (SFT, reward/cost models, the DPO family, ...)."""

    name: str = "base"
    #: "tokens" for token-level losses, "sequences" for per-example losses (ALGORITHMS 6.1).
    loss_unit: str = "tokens"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.skipped: dict[str, int] = {}

    @abstractmethod
    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        """Tokenized examples of the files in ``specs`` (``split`` is 'train' or 'eval')."""

    @abstractmethod
    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """A micro-batch of tensors from a list of examples."""

    @abstractmethod
    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """How many loss units (tokens or sequences) this micro-batch holds."""

    @abstractmethod
    def build_policy(self, dtype: torch.dtype) -> nn.Module:
        """The trainable module (its forward is what the Strategy wraps)."""

    def build_frozen(self, strategy: Any) -> dict[str, nn.Module]:
        """Frozen helper models (reference, reward, cost), already placed by the strategy."""
        return {}

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        """Loss of one micro-batch, already divided by ``normalizer`` (global units / dp_size)."""

    @abstractmethod
    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> MetricSums:
        """Evaluation metric sums of one micro-batch (no grad)."""

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Non-pad tokens processed (for tokens/s)."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return int(batch["input_ids"].numel())

    def before_training(self, model: nn.Module, train_set: list[dict[str, Any]], eval_set: list[dict[str, Any]], strategy: Any) -> None:
        """Called once, after the model is prepared and ``build_frozen`` ran, before the first step
        (and before a resume restores weights). E.g. DPO caches reference log-probs in the examples."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Hook after each optimizer step with the globally reduced metrics (e.g. a dual update)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state that a checkpoint must carry (e.g. a Lagrange multiplier)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PairBatches:
    """Mixin for algorithms over (chosen, rejected) pairs: one packed row, the pair as loss unit.

    The algorithm sets ``pair`` (which pair of a row: ``helpful`` / ``safety``) and, when every row
    must carry per-response safety labels, ``needs_safety_labels``."""

    tokenizer: Any
    cfg: Any
    skipped: dict[str, int]
    pair: str = "helpful"
    needs_safety_labels: bool = False

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg.data
        examples, skipped = load_pairs(
            self.tokenizer,
            specs,
            max_length=d.max_length,
            pair=self.pair,
            chat_template=d.chat_template,
            skip_invalid=d.skip_invalid,
            limit=d.max_train_examples if split == "train" else d.max_eval_examples,
            need_safety_labels=self.needs_safety_labels,
        )
        self.skipped[split] = skipped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return PairCollator(self.tokenizer.pad_token_id, packed=True)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["seq_index"] >= 0).sum())
