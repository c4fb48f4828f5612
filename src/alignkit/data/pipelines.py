"""Data pipelines the algorithms compose: rows -> tokenized examples -> micro-batches.

* :class:`TokenData`: one sequence per example (SFT), loss unit = loss token; padded or packed.
* :class:`PairData`: a (chosen, rejected) pair per example (reward/cost models, the DPO family), the
  2B sequences of a micro-batch in one padding-free packed row, loss unit = pair.

Both keep, per split, what happened to rows that did not become examples unchanged in ``row_counts``
(:class:`~alignkit.data.io.RowCounts`: dropped or kept-but-changed, by cause) and the number dropped in
``skipped``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.collate import TokenCollator, count_loss_tokens
from alignkit.data.io import Row, RowCounts, convert_rows
from alignkit.data.preference import PairCollator, count_pairs, load_pairs


def _limit(cfg: DataConfig, split: str) -> int | None:
    return cfg.max_train_examples if split == "train" else cfg.max_eval_examples


class TokenData:
    """Single sequences ``{input_ids, labels}`` made by ``convert(row)`` (None = nothing to learn)."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, convert: Callable[[Row], dict[str, Any] | None]) -> None:
        self.tokenizer, self.cfg, self.convert = tokenizer, cfg, convert
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        examples, counts = convert_rows(specs, self.convert, skip_invalid=self.cfg.skip_invalid,
                                        limit=_limit(self.cfg, split))
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return TokenCollator(self.tokenizer.pad_token_id, packed=self.cfg.packing)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_loss_tokens(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return int(batch["input_ids"].numel())


class PairData:
    """(chosen, rejected) pairs; ``pair`` picks which pair of a PKU-SafeRLHF row (helpful / safety);
    ``needs_safety_labels`` makes a row without per-response safety labels an error."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, pair: str = "helpful", needs_safety_labels: bool = False) -> None:
        self.tokenizer, self.cfg, self.pair, self.needs_safety_labels = tokenizer, cfg, pair, needs_safety_labels
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg
        examples, counts = load_pairs(
            self.tokenizer, specs, max_length=d.max_length, pair=self.pair, chat_template=d.chat_template,
            skip_invalid=d.skip_invalid, limit=_limit(d, split), need_safety_labels=self.needs_safety_labels,
        )
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return PairCollator(self.tokenizer.pad_token_id, packed=True)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["seq_index"] >= 0).sum())
