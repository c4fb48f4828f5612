"""A toy online algorithm registered from OUTSIDE the package that declares its own experience field and its
own model role: GRPO with a frozen ``judge`` role (the micro model, read-only) whose log-prob of each sampled
token is stored per token as ``judge_logps`` and reaches the loss through alignkit's collate, where it shapes
nothing but is logged. Neither name appears anywhere in alignkit: the algorithm declares both
(``token_fields``, ``model_specs``).

Use: ``plugins: [tests.plugins.judged_grpo]`` and ``algorithm: judged_grpo`` (GRPO's ``grpo:`` keys apply).
Logged: ``judge_logp_rollout`` (the token mean the rollout stored) and ``judge_logp`` (the same mean as the loss
read it from the micro-batches); equal when the field sits at the completion positions of every row.
"""

from __future__ import annotations

import torch

from alignkit.algorithms.base import Batch
from alignkit.algorithms.grpo import GRPO
from alignkit.config.schema import RunConfig
from alignkit.config.sections import register_algorithm
from alignkit.distributed import comm
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.experience import Sample, flat


@register_algorithm("judged_grpo")
class JudgedGRPO(GRPO):
    name = "judged_grpo"
    token_fields = (*GRPO.token_fields, "judge_logps")

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return [*super().model_specs(cfg), ModelSpec("judge", cfg.model.name_or_path, "lm")]

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        stats = super().make_experience(ctx, samples, batches, scores)
        judged = self.tokens.logps(ctx, batches, role="judge")
        for s, logps in zip(samples, judged):
            s["judge_logps"] = logps
        tokens = [v for logps in judged for v in logps]
        total = comm.all_reduce_sum(torch.tensor([sum(tokens), len(tokens)], dtype=torch.float64))  # every rank's
        stats.add("judge_logp_rollout", float(total[0]) / max(1.0, float(total[1])), 1)
        return stats

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        loss, m = super().loss(models, batch, normalizer=normalizer)
        judge = flat(batch, "judge_logps")  # (N,) aligned with the policy's log-probs
        m.add_masked_mean("judge_logp", judge, torch.ones_like(judge))
        return loss, m
