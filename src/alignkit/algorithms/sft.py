"""Supervised fine-tuning: next-token loss on assistant / completion tokens only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm
from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator, count_loss_tokens
from alignkit.data.io import DataError, Row, convert_rows, require_messages, require_str
from alignkit.data.tokenize import encode_chat, encode_prompt_response
from alignkit.losses.sft import sft_loss
from alignkit.models.loading import load_causal_lm
from alignkit.models.policy import CausalLMLogps


def sft_example(tokenizer: Any, row: Row, *, max_length: int, loss_on: str = "assistant") -> dict[str, Any] | None:
    """A row (``messages``, or ``prompt``/``completion``) -> ``{input_ids, labels}``.

    Returns None when truncation leaves no loss token (the caller counts it as skipped).
    """
    d = row.data
    if "messages" in d:
        ids, mask = encode_chat(tokenizer, require_messages(row, "messages"), row)
    elif "prompt" in d or "completion" in d:
        prompt = d.get("prompt")
        prompt = require_messages(row, "prompt") if isinstance(prompt, list) else require_str(row, "prompt")
        comp = d.get("completion")
        comp = require_messages(row, "completion") if isinstance(comp, list) else require_str(row, "completion")
        ids, mask = encode_prompt_response(tokenizer, prompt, comp, row)
    elif "text" in d:
        ids = list(tokenizer(require_str(row, "text"))["input_ids"])
        mask = [1] * len(ids)
    else:
        raise DataError(f"{row.where()}: an SFT row needs 'messages', 'prompt'+'completion' or 'text' (has {sorted(d)})")
    if loss_on == "all":
        mask = [1] * len(ids)
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask[1:]) == 0:  # position 0 is never predicted
        return None
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


class SFT(OfflineAlgorithm):
    name = "sft"
    loss_unit = "tokens"

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg.data
        limit = d.max_train_examples if split == "train" else d.max_eval_examples
        examples, skipped = convert_rows(
            specs,
            lambda row: sft_example(self.tokenizer, row, max_length=d.max_length, loss_on=self.cfg.sft.loss_on),
            skip_invalid=d.skip_invalid,
            limit=limit,
        )
        self.skipped[split] = skipped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return TokenCollator(self.tokenizer.pad_token_id, packed=self.cfg.data.packing)(examples)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_loss_tokens(batch)

    def build_policy(self, dtype: torch.dtype) -> nn.Module:
        return CausalLMLogps(load_causal_lm(self.cfg.model, dtype=dtype), chunk_size=self.cfg.sft.logps_chunk_size)

    def _logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(
            input_ids=batch["input_ids"],
            targets=batch["targets"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        )

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        logps = self._logps(model, batch)  # (N,) over loss tokens
        m = MetricSums()
        m.add("nll", -logps.detach().sum(), logps.numel())
        return sft_loss(logps, normalizer=normalizer), m

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> MetricSums:
        logps = self._logps(model, batch)
        m = MetricSums()
        m.add("loss", -logps.sum(), logps.numel())
        return m
