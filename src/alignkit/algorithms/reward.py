"""Reward and cost models: a scalar head scored at each response's last token (ALGORITHMS 1.2, 4).

* ``reward_model``: Bradley-Terry  -log sigma(r_c - r_r - m)  (+ centring, + L2), on helpful pairs
  by default (``reward.pair``).
* ``cost_model``: the Safe RLHF cost model on safety pairs, C > 0 meaning unsafe: the ranking
  term  -log sigma(C_unsafer - C_safer)  plus the two sign terms from the per-response safety
  labels (``losses.cost_model_loss``).

Both are per-pair losses (``loss_unit = "sequences"``: one unit per pair). The 2B responses of a
micro-batch go through ONE forward in the padding-free packed layout (``PairCollator``).
Metrics: ``accuracy`` (pairwise; for the cost model, the unsafer response costs more) and
``margin`` (r_c - r_r; cost model: C_unsafer - C_safer), both positive when the model is right.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm, PairBatches
from alignkit.data.preference import count_pairs
from alignkit.errors import ConfigError
from alignkit.losses.cost import cost_model_loss
from alignkit.losses.reward import bradley_terry_loss
from alignkit.models.scalar import ScalarHeadModel, load_scalar_model


class RewardModel(PairBatches, OfflineAlgorithm):
    name = "reward_model"
    loss_unit = "sequences"
    default_pair = "helpful"

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        r = cfg.reward
        self.pair = self.default_pair if r.pair == "auto" else r.pair

    # ------------------------------------------------------------------ model
    def build_policy(self, dtype: torch.dtype) -> nn.Module:
        return ScalarHeadModel(load_scalar_model(self.cfg.model, dtype=dtype, pad_token_id=self.tokenizer.pad_token_id))

    @staticmethod
    def scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(2B,)`` scores: chosen 0..B-1 then rejected 0..B-1."""
        return model(
            input_ids=batch["input_ids"],
            seq_index=batch["seq_index"],
            num_seqs=int(batch["response_lengths"].shape[0]),
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        )

    def pair_loss(self, scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        """Per-pair losses ``(B,)`` and metric sums from the 2B scores."""
        r = self.cfg.reward
        b = count_pairs(batch)
        margin = batch["margin"].to(scores.dtype)
        margin = torch.where(torch.isnan(margin), torch.full_like(margin, r.margin), margin)
        losses, met = bradley_terry_loss(
            scores[:b], scores[b:], margin=margin, center_coeff=r.center_coeff, reg_coeff=r.reg_coeff
        )
        m = MetricSums()
        m.add_mean("accuracy", met["accuracy"])
        m.add_mean("margin", met["margin"])
        m.add_mean("score/chosen", met["chosen"])
        m.add_mean("score/rejected", met["rejected"])
        return losses, m

    # ------------------------------------------------------------------ math
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        losses, m = self.pair_loss(self.scores(model, batch), batch)
        return losses.sum() / normalizer, m

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> MetricSums:
        losses, m = self.pair_loss(self.scores(model, batch), batch)
        m.add_mean("loss", losses)
        return m


class CostModel(RewardModel):
    name = "cost_model"
    default_pair = "safety"
    needs_safety_labels = True

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        r = cfg.reward
        if self.pair != "safety":
            raise ConfigError("reward.pair: the cost model ranks responses by safety; use auto or safety")
        if r.margin or r.center_coeff:
            raise ConfigError("reward.margin / reward.center_coeff: reward_model options; the cost model's "
                              "sign terms already pin C = 0 as the safe/unsafe boundary")

    def pair_loss(self, scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        # chosen = the safer response, rejected = the unsafer one (PairText ordering for pair=safety)
        b = count_pairs(batch)
        losses, met = cost_model_loss(
            scores[b:], scores[:b], batch["rejected_unsafe"], batch["chosen_unsafe"], reg_coeff=self.cfg.reward.reg_coeff
        )
        m = MetricSums()
        m.add_mean("accuracy", met["accuracy"])
        m.add_mean("margin", met["unsafer"] - met["safer"])
        m.add_mean("sign_accuracy", met["sign_accuracy"])
        m.add_mean("cost/unsafer", met["unsafer"])
        m.add_mean("cost/safer", met["safer"])
        return losses, m
