"""Micro-batch assembly: right padding, or padding-free packing with per-example positions.

Both layouts yield ``targets`` already shifted per example (``targets[t]`` is the token the
model must predict after position t, or IGNORE_INDEX), so a packed row never asks the last
token of one example to predict the first token of the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch


def shift_labels(labels: list[int]) -> list[int]:
    """targets[t] = labels[t+1]; the last position predicts nothing."""
    return labels[1:] + [IGNORE_INDEX]


@dataclass
class TokenCollator:
    """Collates examples ``{"input_ids": [...], "labels": [...]}`` (plus optional per-example extras).

    ``packed=True`` concatenates the micro-batch into one row (B=1) with ``position_ids`` that
    restart at 0 for every example; transformers builds a block-diagonal causal mask from them,
    so no token attends across examples and no compute is spent on padding.
    """

    pad_token_id: int
    packed: bool = False

    def __call__(self, examples: list[dict[str, Any]]) -> Batch:
        if self.packed:
            return self._packed(examples)
        return self._padded(examples)

    def _padded(self, examples: list[dict[str, Any]]) -> Batch:
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"])
            targets[i, :n] = torch.tensor(shift_labels(e["labels"]))
            attn[i, :n] = 1
        seq_index = torch.arange(len(examples)).unsqueeze(1).expand(-1, width).masked_fill(attn == 0, -1)
        return Batch({"input_ids": ids, "attention_mask": attn}, {"targets": targets, "seq_index": seq_index})

    def _packed(self, examples: list[dict[str, Any]]) -> Batch:
        ids: list[int] = []
        targets: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids += e["input_ids"]
            targets += shift_labels(e["labels"])
            pos += list(range(n))
            seq += [i] * n
        return Batch({"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos])},
                     {"targets": torch.tensor([targets]), "seq_index": torch.tensor([seq])})


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["targets"] != IGNORE_INDEX).sum())
