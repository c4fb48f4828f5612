"""ORPO (Hong et al. 2024): SFT on the chosen response plus an odds-ratio preference term, no reference model.

Per micro-batch of B pairs: ONE forward over all 2B sequences (chosen then rejected) in a single
padding-free packed row, as DPO (``algorithms/dpo.py``); per-sequence log-prob sums over response
tokens only; then the pure ``losses.orpo_loss`` on the length-normalised log-probs. Loss unit: one
pair. Rows are DPO's (``data.preference``: prompt/chosen/rejected, or PKU-SafeRLHF with ``orpo.pair``);
a row without a chosen response is a one-line error naming its file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from alignkit.algorithms.base import Batch, OfflineAlgorithm, policy_specs
from alignkit.algorithms.dpo import DPO
from alignkit.algorithms.vlm import preference_inputs, vlm_spec_options
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.pipelines import PairData
from alignkit.data.preference import count_pairs
from alignkit.losses.orpo import orpo_loss
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec


@register_section("orpo")
@dataclass
class ORPOConfig:
    beta: float = f(0.1, "lambda, the weight of the odds-ratio term against the SFT loss (TRL's beta; "
                    "paper: 0.1-0.25).", gt=0)
    pair: Literal["helpful", "safety"] = f("helpful", "Pair of a PKU-SafeRLHF row to train on.")
    logps_chunk_size: int = f(
        0, "Rows of hidden states per LM-head chunk in the log-prob op; 0 = chosen by memory.", ge=0)


class ORPO(OfflineAlgorithm):
    name = "orpo"
    sequences_per_example = 2

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        saved, self.processor = preference_inputs(cfg, tokenizer)
        text_tokenizer = self.processor.tokenizer if self.processor is not None else tokenizer
        super().__init__(cfg, saved, PairData(text_tokenizer, cfg.data, pair=cfg.section(ORPOConfig).pair,
                                              processor=self.processor))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        vlm = vlm_spec_options(cfg)
        return policy_specs(cfg, "none", kind="vlm" if vlm else "lm",
                            chunk_size=cfg.section(ORPOConfig).logps_chunk_size, **vlm)

    def _pair_losses(self, models: Models, batch: Batch) -> tuple[torch.Tensor, MetricSums]:
        b = count_pairs(batch)
        logps = models.sequence_logps("policy", batch)
        lengths = batch["response_lengths"].to(logps.dtype)
        losses, met = orpo_loss(logps[:b], logps[b:], lengths[:b], lengths[b:], beta=self.cfg.section(ORPOConfig).beta)
        m = MetricSums()
        for name, values in met.items():
            m.add_mean(name, values)
        margin = met["rewards/margin"]  # a tie counts as half right, as in DPO
        m.add_mean("rewards/accuracy", (margin > 0).double() + 0.5 * (margin == 0).double())
        return losses, m

    # DPO's: the per-pair losses summed over the global normaliser; evaluation adds their mean
    loss = DPO.loss
    eval_step = DPO.eval_step
