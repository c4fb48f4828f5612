"""Reward and cost models: a scalar head scored at each response's last token (ALGORITHMS 1.2, 4).

* ``reward_model``: Bradley-Terry  -log sigma(r_c - r_r - m)  (+ centring, + L2), on helpful pairs
  by default (``reward_model.pair``).
* ``cost_model``: the Safe RLHF cost model on safety pairs, C > 0 meaning unsafe: the ranking
  term  -log sigma(C_unsafer - C_safer)  plus the two sign terms from the per-response safety
  labels (``losses.cost_model_loss``).

Both are per-pair losses (one loss unit per pair: ``data.loss_units``). The 2B responses of a
micro-batch go through ONE forward in the padding-free packed layout (``PairCollator``).
Image + text rows train a vision-language reward / cost model (a score head on LLaVA, ``models.vlm``).
Both read the ``reward_model:`` section (how the scalar model is trained); ``reward:`` is how the online
algorithms score completions (functions, a trained reward model, a length penalty).
Metrics: ``accuracy`` (pairwise; for the cost model, the unsafer response costs more) and
``margin`` (r_c - r_r; cost model: C_unsafer - C_safer), both positive when the model is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from alignkit.algorithms.base import Batch, OfflineAlgorithm
from alignkit.algorithms.vlm import preference_inputs, vlm_spec_options
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.pipelines import PairData
from alignkit.data.preference import count_pairs
from alignkit.errors import ConfigError
from alignkit.losses.cost import cost_model_loss
from alignkit.losses.reward import bradley_terry_loss
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec
from alignkit.rewards.functions import REWARD_FUNCTIONS


@dataclass
class RewardFunctionConfig:
    name: str = f("", "A builtin reward function or 'module:function'.")
    weight: float = f(1.0, "Weight of this function in the total reward.")

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("reward.functions: each entry needs a name (a builtin or 'module:function')")
        if ":" not in self.name and self.name not in REWARD_FUNCTIONS:
            REWARD_FUNCTIONS.get(self.name)  # the one-line error with the closest name


@register_section("reward_model")
@dataclass
class RewardModelConfig:
    """Training a scalar model: algorithm reward_model, and cost_model (pair, reg_coeff)."""

    pair: Literal["auto", "helpful", "safety"] = f(
        "auto", "Pair of a PKU-SafeRLHF row: helpful (by better_response_id) or safety (by safer_response_id); "
        "auto = helpful for reward_model, safety for cost_model."
    )
    margin: float = f(0.0, "reward_model: Bradley-Terry margin m in -log sigma(r_c - r_r - m); a row's own "
                      "numeric 'margin' field takes precedence.", ge=0)
    center_coeff: float = f(0.0, "reward_model: centring term center_coeff * (r_c + r_r)^2 per pair "
                            "(TRL center_rewards_coefficient).", ge=0)
    reg_coeff: float = f(0.0, "L2 regulariser reg_coeff * mean(score^2) over both responses (Safe RLHF).", ge=0)


@register_section("reward")
@dataclass
class RewardConfig:
    """How the online algorithms (grpo, rloo, dr_grpo, ppo, ppo_lag) score completions."""

    functions: list[RewardFunctionConfig] = f(
        [], "Online: reward functions with weights, e.g. [{name: exact_match, weight: 1.0}, {name: "
        "'my_pkg.rewards:fn', weight: 0.5}]; builtins: " + ", ".join(REWARD_FUNCTIONS.names()) + ".")
    model: Optional[str] = f(None, "Online: a trained reward model (a reward_model run's final dir) added to the "
                             "functions with weight model_weight.")
    model_weight: float = f(1.0, "Online: weight of reward.model's score.")
    length_penalty: float = f(0.0, "Online: subtract length_penalty x completion tokens / rollout.max_new_tokens.", ge=0)
    placement: Literal["local", "main"] = f(
        "local", "Online: where reward functions run: local = each rank scores its own samples; main = gathered "
        "to rank 0, scored there, each rank receiving the scores of ITS OWN samples.")


def scalar_spec(cfg: RunConfig, role: str) -> ModelSpec:
    """The trainable scalar-head model of a reward (``reward``) or cost (``cost``) model run (of a
    vision-language model: a score head on LLaVA, the parts ``vlm`` names trained)."""
    return ModelSpec(role, cfg.model.name_or_path, "scalar", trainable=True, lora=cfg.model.lora is not None,
                     **vlm_spec_options(cfg, "scalar"))


def pair_data(cfg: RunConfig, tokenizer: Any, pair: str, needs_safety_labels: bool = False) -> tuple[Any, PairData]:
    """(what checkpoints save beside the weights, the pair pipeline) of a reward / cost model run."""
    saved, processor = preference_inputs(cfg, tokenizer)
    tok = processor.tokenizer if processor is not None else tokenizer
    return saved, PairData(tok, cfg.data, pair=pair, needs_safety_labels=needs_safety_labels, processor=processor)


class ScoredPairs(OfflineAlgorithm):
    """A trained scalar model scores the 2B responses of a micro-batch in one forward; ``pair_loss`` turns
    the scores into per-pair losses and metrics (reward and cost models)."""

    sequences_per_example = 2
    config_sections = ("reward_model",)  # the cost model's settings too

    def pair_loss(self, scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, MetricSums]:
        raise NotImplementedError

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        losses, m = self.pair_loss(models.scores(models.primary, batch), batch)
        return losses.sum() / normalizer, m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        losses, m = self.pair_loss(models.scores(models.primary, batch), batch)
        m.add_mean("loss", losses)
        return m


class RewardModel(ScoredPairs):
    name = "reward_model"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        pair = "helpful" if cfg.section(RewardModelConfig).pair == "auto" else cfg.section(RewardModelConfig).pair
        super().__init__(cfg, *pair_data(cfg, tokenizer, pair))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return [scalar_spec(cfg, "reward")]

    def pair_loss(self, scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, MetricSums]:
        """Per-pair losses ``(B,)`` and metric sums from the 2B scores (chosen 0..B-1, then rejected)."""
        r = self.cfg.section(RewardModelConfig)
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


class CostModel(ScoredPairs):
    name = "cost_model"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        r = cfg.section(RewardModelConfig)
        if r.pair not in ("auto", "safety"):
            raise ConfigError("reward_model.pair: the cost model ranks responses by safety; use auto or safety")
        if r.margin or r.center_coeff:
            raise ConfigError("reward_model.margin / reward_model.center_coeff: options of algorithm reward_model only; "
                              "the cost model's sign terms already pin C = 0 as the safe/unsafe boundary")
        super().__init__(cfg, *pair_data(cfg, tokenizer, "safety", needs_safety_labels=True))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return [scalar_spec(cfg, "cost")]

    def pair_loss(self, scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, MetricSums]:
        # chosen = the safer response, rejected = the unsafer one (PairText ordering for pair=safety)
        b = count_pairs(batch)
        losses, met = cost_model_loss(
            scores[b:], scores[:b], batch["rejected_unsafe"], batch["chosen_unsafe"], reg_coeff=self.cfg.section(RewardModelConfig).reg_coeff
        )
        m = MetricSums()
        m.add_mean("accuracy", met["accuracy"])
        m.add_mean("margin", met["unsafer"] - met["safer"])
        m.add_mean("sign_accuracy", met["sign_accuracy"])
        m.add_mean("cost/unsafer", met["unsafer"])
        m.add_mean("cost/safer", met["safer"])
        return losses, m
