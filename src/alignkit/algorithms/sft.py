"""Supervised fine-tuning: next-token loss on assistant / completion tokens only."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch

from alignkit.algorithms.base import Batch, OfflineAlgorithm
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import NOTHING_TO_LEARN, PROMPT_TOO_LONG, TRUNCATED, DataError, Row, require_messages, require_str
from alignkit.data.pipelines import TokenData
from alignkit.data.tokenize import encode_chat, encode_prompt_response
from alignkit.losses.sft import sft_loss
from alignkit.metrics import MetricSums
from alignkit.models.policy import forward_liger_nll
from alignkit.models.roles import Models, ModelSpec


@register_section("sft")
@dataclass
class SFTConfig:
    loss_on: Literal["assistant", "all"] = f("assistant", "Train on assistant/completion tokens or all.")
    logps_chunk_size: int = f(
        0, "Rows of hidden states per LM-head chunk in the loss; 0 = chosen by memory "
        "(512 MiB of float32 logits per chunk on a GPU, 32 MiB on a CPU).", ge=0)



def sft_example(tokenizer: Any, row: Row, *, max_length: int, loss_on: str = "assistant") -> dict[str, Any] | None:
    """A row (``messages``, or ``prompt``/``completion``) -> ``{input_ids, labels}``.

    Returns None when the row has no loss token, or none within ``max_length`` (the prompt is longer);
    the row says which (``row.drop``), and notes a truncation (``row.note``), for the start-up log.
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
    if sum(mask[1:]) == 0:  # position 0 is never predicted
        row.drop(NOTHING_TO_LEARN)
        return None
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask[1:]) == 0:
            row.drop(PROMPT_TOO_LONG)
            return None
        row.note(TRUNCATED)
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


class SFT(OfflineAlgorithm):
    name = "sft"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        d, opts = cfg.data, cfg.section(SFTConfig)
        convert = functools.partial(sft_example, tokenizer, max_length=d.max_length, loss_on=opts.loss_on)
        super().__init__(cfg, tokenizer, TokenData(tokenizer, d, convert, fmt=f"sft:loss_on={opts.loss_on}"))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return [ModelSpec("policy", cfg.model.name_or_path, "lm", trainable=True, lora=cfg.model.lora is not None,
                          chunk_size=cfg.section(SFTConfig).logps_chunk_size)]

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        m = MetricSums()
        if self.cfg.training.liger_kernel:  # Liger's fused head + cross-entropy: the summed NLL only
            nll = forward_liger_nll(models["policy"], batch)
            m.add("nll", nll.detach(), batch["targets"].ne(IGNORE_INDEX).sum())
            return sft_loss(-nll, normalizer=normalizer), m
        logps = models.logps("policy", batch)  # (N,) over loss tokens
        m.add("nll", -logps.detach().sum(), logps.numel())
        return sft_loss(logps, normalizer=normalizer), m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        logps = models.logps("policy", batch)
        m = MetricSums()
        m.add("loss", -logps.sum(), logps.numel())
        return m
