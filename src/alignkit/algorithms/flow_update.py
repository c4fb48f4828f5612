"""Flow-GRPO's trained half as a part, usable on any role: the SDE sampler drawing a role's images through
``ctx.generate``, the (image, denoising step) loss units, their advantages and the clipped flow loss with the KL to
the role's reference. ``flow_grpo`` builds one on ``policy``; ``flow_rtpo`` one on ``image_policy`` beside its
attacker (``algorithms/flow_grpo.py`` and ``algorithms/flow_rtpo.py`` say what each feeds it).
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.algorithms.base import Batch
from alignkit.algorithms.flow_sft import seeded
from alignkit.algorithms.grpo import group_stats
from alignkit.losses.flow import flow_grpo_loss
from alignkit.metrics import MetricSums
from alignkit.models.diffusion_sample import (
    FlowSampling,
    ImageGenerations,
    ImagePrompt,
    transition_batch,
    transition_units,
)
from alignkit.models.roles import Models
from alignkit.rollout.advantages import GroupAdvantages
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.experience import Sample


class FlowUpdate:
    """Flow-GRPO's sampler, units, advantages and loss for the flow ``role`` (its KL reference ``reference_role``,
    served as ``reference``: none | model | lora_base), with the settings of ``opts`` (the ``flow_grpo:`` section)
    and the run's seed (``seed``)."""

    def __init__(self, opts: Any, seed: int, *, role: str, reference_role: str, reference: str) -> None:
        self.opts, self.seed = opts, seed
        self.role, self.reference_role, self.reference = role, reference_role, reference

    # ------------------------------------------------------------------ sampling
    def sampling_summary(self) -> str:
        o = self.opts
        return (f"{o.num_inference_steps} SDE steps ({o.train_steps} trained, noise_level={o.noise_level}), "
                f"guidance={o.guidance_scale}, {o.resolution} px; evaluation: {o.eval_num_inference_steps} ODE steps")

    def sampling(self, steps: int, noise_level: float) -> FlowSampling:
        """The diffusion kind's sampler settings: ``steps`` steps at ``noise_level`` (0: the ODE), the rest the
        section's."""
        o = self.opts
        return FlowSampling(steps, noise_level, o.guidance_scale, o.resolution, o.max_sequence_length,
                            o.negative_prompt)

    def render(self, ctx: RolloutContext, prompts: list[str], keys: list[str], *, steps: int, noise_level: float,
               step: int) -> ImageGenerations:
        """The images of ``prompts`` with their trajectories, drawn by the role's kind through ``ctx.generate``
        (image i's noise seeded by (seed, ``step``, ``keys[i]``)); the seconds are the rollout's ``sample`` phase
        (time/sample_s), kept apart from the token ``generate`` phase whose seconds give gen_tokens_per_s."""
        requests = [ImagePrompt(p, seeded(self.seed, step, key)) for p, key in zip(prompts, keys)]
        return ctx.generate(self.role, requests, self.sampling(steps, noise_level), phase="sample")

    # ------------------------------------------------------------------ experience
    def units_of(self, drawn: ImageGenerations, prompts: list[str]) -> list[Sample]:
        """One loss unit per (image, trained denoising step), step-major (a micro-batch holds one step of
        several images, as flow_grpo's): the stored transition (``transition_units``), ``old_logp`` the sampler's,
        ``image`` its index on this rank (``prompt`` its prompt: samples.jsonl). Tensors stay on the device."""
        units = transition_units(drawn, self.opts.train_steps)
        for u in units:
            u["old_logp"], u["prompt"] = u.pop("logp"), prompts[u["image"]]
        return units

    def advantages(self, group_size: int) -> GroupAdvantages:
        """GRPO's estimator over groups of ``group_size`` images (``statistics: prompt``) or the whole batch, the
        std of every gathered reward with ``global_std``, clamped to ``adv_clip_max``."""
        o = self.opts
        return GroupAdvantages("grpo", group_size, "batch" if o.global_std else "group", o.statistics, o.adv_clip_max)

    def experience(self, samples: list[Sample], reward: torch.Tensor, group_size: int,
                   mine: slice) -> tuple[MetricSums, torch.Tensor]:
        """Advantages from the gathered ``(global,)`` ``reward`` (the same on every rank); each unit of ``samples``
        gets its image's (``mine``: this rank's images in the global order). Returns the statistics and the
        ``(global,)`` advantages."""
        adv = self.advantages(group_size)(reward)
        values, rewards = adv[mine].tolist(), reward[mine].tolist()
        for s in samples:
            s["advantage"] = torch.tensor(values[s["image"]])
            s["log"] = {"reward": rewards[s["image"]], "advantage": values[s["image"]]}
        return group_stats(reward, adv, group_size), adv

    # ------------------------------------------------------------------ update
    def collate(self, samples: list[Sample]) -> Batch:
        return transition_batch(samples, ("old_logp", "advantage"))

    def units(self, batch: Batch) -> int:
        return int(batch["advantage"].numel())

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        o = self.opts
        params = self.sampling(o.num_inference_steps, o.noise_level)
        ref_mean = None
        if self.reference != "none":
            with torch.no_grad():
                ref_mean = models.logps(self.reference_role, batch, params=params, with_step=True).mean
        new = models.logps(self.role, batch, params=params, with_step=True)
        loss, parts = flow_grpo_loss(new.logp, batch["old_logp"], batch["advantage"], clip_range=o.clip_range,
                                     normalizer=normalizer, mean=new.mean, ref_mean=ref_mean, std_t=new.std_t,
                                     beta=o.beta if ref_mean is not None else 0.0)
        m = MetricSums()
        m.add_mean("policy_loss", parts["policy"])
        m.add_mean("clip_fraction", parts["clipped"])
        m.add_mean("ratio", parts["ratio"])
        m.add_mean("approx_kl", 0.5 * (new.logp.detach() - batch["old_logp"]).pow(2))
        if ref_mean is not None:
            m.add_mean("kl", parts["kl"])
        return loss, m
