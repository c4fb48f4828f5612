"""A plugin for benchmarks/offpolicy_corrections.py: GRPO whose completions are drawn by the policy of ``LAG``
iterations ago (a synthetic behaviour mismatch, as an asynchronous generator ``LAG`` versions behind), with that
policy's log-probs of the sampled tokens recorded as ``sampler_logps``, so the ``off_policy:`` correction is what
the loss applies. ``LAG`` is read from the environment (``OFFPOLICY_LAG``, default 4).

Use: ``plugins: [benchmarks.offpolicy_lag]`` and ``algorithm: grpo_lagged`` (from the repository root)."""

from __future__ import annotations

import collections
import os

import torch

from alignkit.algorithms.base import Batch
from alignkit.algorithms.grpo import GRPO
from alignkit.config.sections import register_algorithm
from alignkit.metrics import MetricSums
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample


@register_algorithm("grpo_lagged")
class LaggedGRPO(GRPO):
    name = "grpo_lagged"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lag = int(os.environ.get("OFFPOLICY_LAG", "4"))
        self.history: collections.deque = collections.deque(maxlen=self.lag + 1)
        self.current: dict[str, torch.Tensor] | None = None

    def rollout(self, ctx: RolloutContext) -> Experience:
        module = ctx.models["policy"]
        now = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.history.append(now)
        self.current = now
        module.load_state_dict(self.history[0])  # the behaviour policy: LAG iterations ago (or the oldest kept)
        try:
            return super().rollout(ctx)
        finally:
            if self.current is not None:
                module.load_state_dict(self.current)

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        behaviour = self.tokens.logps(ctx, batches)  # the lagged weights are still loaded
        for s, logps in zip(samples, behaviour):
            s["sampler_logps"] = logps
        ctx.models["policy"].load_state_dict(self.current)  # the trainer's (proximal) policy from here on
        self.current = None
        return super().make_experience(ctx, samples, batches, scores)
