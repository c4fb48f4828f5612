"""Data pipelines the algorithms compose: rows -> tokenized examples -> micro-batches.

* :class:`TokenData`: one sequence per example (SFT), loss unit = loss token; padded or packed.
* :class:`PairData`: a (chosen, rejected) pair per example (reward/cost models, the DPO family), the
  2B sequences of a micro-batch in one padding-free packed row, loss unit = pair.

With a row format (``fmt``: the conversion and its options, part of the cache key) a pipeline's
examples come from the Arrow cache (:mod:`alignkit.data.cache`, :mod:`alignkit.data.assemble`): read
and tokenised once, by rank 0, memory-mapped by every rank, as an
:class:`~alignkit.data.examples.ExampleTable`. Without one (a pipeline that gives no ``fmt``) rows
are converted into a list in memory on every rank, as before.

Both keep, per split, what happened to rows that did not become examples unchanged in ``row_counts``
(:class:`~alignkit.data.io.RowCounts`: dropped or kept-but-changed, by cause) and the number dropped in
``skipped``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.assemble import cache_root, load_examples
from alignkit.data.cache import Job
from alignkit.data.collate import TokenCollator, count_loss_tokens
from alignkit.data.io import Row, RowCounts, convert_rows
from alignkit.data.preference import PairCollator, count_pairs, pair_converter
from alignkit.data.vlm import PixelCache


def _limit(cfg: DataConfig, split: str) -> int | None:
    return cfg.max_train_examples if split == "train" else cfg.max_eval_examples


def token_features() -> dict[str, str]:
    """The fields of a token example, as type strings (:class:`~alignkit.data.cache.Job`): plain data, so
    building a pipeline does not import ``datasets`` (only preparing a cache does)."""
    return {"input_ids": "int32[]", "labels": "int32[]"}


def pair_features() -> dict[str, str]:
    return {"chosen_ids": "int32[]", "chosen_labels": "int32[]", "rejected_ids": "int32[]",
            "rejected_labels": "int32[]", "margin": "float64", "chosen_unsafe": "bool", "rejected_unsafe": "bool"}


def cached_examples(tokenizer: Any, cfg: DataConfig, specs: list[str], split: str, convert: Callable[[Row], Any],
                    fmt: str, features: Any) -> tuple[Any, RowCounts]:
    """The examples of ``specs`` from the cache (prepared first if it lacks them), and the row counts."""
    job = Job(convert, fmt, features, tokenizer, cfg.max_length, cfg.num_proc)
    train = split == "train"
    weights = cfg.train_weights if train and list(specs) == list(cfg.train) else None
    return load_examples(specs, job, root=cache_root(cfg.cache_dir), skip_invalid=cfg.skip_invalid,
                         limit=_limit(cfg, split), split=cfg.train_split if train else cfg.eval_split,
                         config=cfg.train_config if train else cfg.eval_config, weights=weights or None)


class TokenData:
    """Single sequences ``{input_ids, labels}`` made by ``convert(row)`` (None = nothing to learn)."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, convert: Callable[[Row], dict[str, Any] | None],
                 fmt: str | None = None, features: Any = None) -> None:
        self.tokenizer, self.cfg, self.convert, self.fmt = tokenizer, cfg, convert, fmt
        self.features = token_features() if fmt is not None and features is None else features
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def build_dataset(self, specs: list[str], split: str) -> Any:
        if self.fmt is None:
            examples, counts = convert_rows(specs, self.convert, skip_invalid=self.cfg.skip_invalid,
                                            limit=_limit(self.cfg, split))
        else:
            examples, counts = cached_examples(self.tokenizer, self.cfg, specs, split, self.convert, self.fmt,
                                               self.features)
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def convert_row(self, row: Row) -> dict[str, Any] | None:
        """One row -> its example (streaming reads rows one at a time)."""
        return self.convert(row)

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return TokenCollator(self.tokenizer.pad_token_id, packed=self.cfg.packing,
                             multiple=self.cfg.pack_multiple_of)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_loss_tokens(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return int((batch["seq_index"] >= 0).sum())  # a packed row: its padding segment (pack_multiple_of) left out


class PairData:
    """(chosen, rejected) pairs; ``pair`` picks which pair of a PKU-SafeRLHF row (helpful / safety);
    ``needs_safety_labels`` makes a row without per-response safety labels an error. With ``processor`` (a
    vision-language model's) rows may carry images; such examples are converted in memory (the Arrow
    cache holds token rows only) and the collator adds ``pixel_values``."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, pair: str = "helpful", needs_safety_labels: bool = False,
                 processor: Any = None) -> None:
        self.tokenizer, self.cfg, self.pair, self.needs_safety_labels = tokenizer, cfg, pair, needs_safety_labels
        self.processor = processor
        self.pixels = PixelCache()  # a VLM's preprocessed images, read once over the epochs
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def converter(self) -> pair_converter:
        d = self.cfg
        return pair_converter(self.tokenizer, max_length=d.max_length, pair=self.pair, chat_template=d.chat_template,
                              need_safety_labels=self.needs_safety_labels, processor=self.processor,
                              image_root=d.image_root)

    @property
    def fmt(self) -> str:
        return (f"pairs:pair={self.pair}:chat_template={self.cfg.chat_template}:"
                f"safety_labels={self.needs_safety_labels}")

    def convert_row(self, row: Row) -> dict[str, Any] | None:
        return self.converter()(row)

    def build_dataset(self, specs: list[str], split: str) -> Any:
        d = self.cfg
        if self.processor is not None:
            examples, counts = convert_rows(specs, self.converter(), skip_invalid=d.skip_invalid, limit=_limit(d, split))
        else:
            examples, counts = cached_examples(self.tokenizer, d, specs, split, self.converter(), self.fmt,
                                               pair_features())
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return PairCollator(self.tokenizer.pad_token_id, packed=True, processor=self.processor,
                            cache=self.pixels)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["seq_index"] >= 0).sum())
