"""Flow-GRPO (``algorithm: flow_grpo``; ALGORITHMS 2.4, Liu et al., arXiv 2505.05470, yifan123/flow_grpo): a
flow-matching text-to-image policy (``model.kind: diffusion``, LoRA on its transformer) trained by online RL.

Per iteration of the online loop (``num_generations`` images per prompt, groups contiguous in global order):

1. rollout: this rank's images drawn by the policy's kind (``ctx.generate``: the diffusion kind's SDE sampler,
   ``models/diffusion_sample.py``: sigma_t = a sqrt(t / (1 - t)), ``num_inference_steps`` steps, classifier-free
   guidance) with the log-prob of every transition; each image's
   noise from a generator seeded by (``training.seed``, the optimizer step, its global index), so images are
   the same over any split into ranks and after a resume;
2. rewards: the scorers of ``flow_grpo.scorers`` (the red-team registry: ``shapes_colour``, ``clip_quality``,
   reward functions, ``module:function``) on the decoded images and their prompts, on each rank or on rank 0
   with every rank receiving ITS OWN images' values (``placement``), gathered in global order; R = main +
   w_cvar max(0, main - VaR_tau) + w_quality quality over the GATHERED batch (``rewards/cvar.py``);
3. advantages (identical on every rank): per prompt ((r - mean_prompt) / (std + 1e-4); ``global_std``, the
   default as in flow_grpo's SD3 configs: the std of the whole batch) or global, clamped to +-``adv_clip_max``;
   one per image, shared by its timesteps;
4. update: each (image, denoising step) pair of the first ``timestep_fraction`` of the steps is a loss unit
   (flow_grpo's per-timestep accumulation); its log-prob is recomputed under the current policy at the stored
   latents (``models.logps``: the kind's transition at the stored latents) and the loss (``losses/flow.py``
   ``flow_grpo_loss``: clipped ratio, + beta KL of the step's mean to
   the LoRA-off base) is summed over the step's pairs / (global pairs / dp_size) by the shared step code;
   ``rollout.mini_batches: 2`` (the shipped recipe, as flow_grpo's two optimizer steps per epoch) splits the
   images into two disjoint halves, the second scored by the policy the first step moved (ratio != 1, clipped).

Evaluation renders every eval prompt once with the deterministic ODE sampler (``eval_num_inference_steps``) and
reports the mean of the ``main`` reward (eval/reward_mean).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from alignkit.algorithms.base import Batch, Context, Example, policy_specs, resolve_reference
from alignkit.algorithms.flow_sft import StepSeeded
from alignkit.algorithms.flow_update import FlowUpdate
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.algorithms.redteam import RedTeamScorerConfig
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.captions import ImagePromptData
from alignkit.errors import ConfigError
from alignkit.metrics import MetricSums
from alignkit.models.diffusion_sample import (
    flow_policy,
)
from alignkit.models.ema import ParamEMA
from alignkit.models.roles import ImageShape, Models, ModelSpec
from alignkit.rewards.cvar import CVaRConfig
from alignkit.rewards.scorers import Judged, ScorerSet, check_scorer_name
from alignkit.rewards.signals import gather_scores
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample

log = logging.getLogger("alignkit")


@dataclass
class FlowScorerConfig(RedTeamScorerConfig):
    use: Literal["main", "quality"] = f(  # type: ignore[assignment]
        "main", "Which term of the reward it adds to: main (the reward the CVaR bonus reads) or quality (times "
        "w_quality).")

    def __post_init__(self) -> None:
        check_scorer_name(self.name, "flow_grpo.scorers")


@register_section("flow_grpo")
@dataclass
class FlowGRPOConfig(CVaRConfig):
    """``algorithm: flow_grpo``: sampler, loss and reward of Flow-GRPO (module docstring); ``tau``, ``w_cvar`` and
    ``w_quality`` are the CVaR keys ``redteam:`` has too (``CVaRConfig``, rewards/cvar.py), with their own defaults."""

    resolution: int = f(512, "Side of the square images in pixels (a multiple of the VAE's downsampling).", gt=0)
    num_inference_steps: int = f(10, "Denoising steps of the training rollouts (flow_grpo: 10).", gt=0)
    eval_num_inference_steps: int = f(40, "Denoising steps of evaluation and the ODE sampler (flow_grpo: 40).", gt=0)
    guidance_scale: float = f(4.5, "Classifier-free guidance scale of sampling and of the loss's forward; <= 1 = off.", ge=0)
    negative_prompt: str = f("", "The unconditional prompt of classifier-free guidance.")
    noise_level: float = f(0.7, "a of the SDE's noise scale sigma_t = a sqrt(t / (1 - t)).", gt=0)
    timestep_fraction: float = f(0.99, "Train on the first int(num_inference_steps x this) denoising steps.", gt=0, le=1)
    clip_range: float = f(1e-4, "Ratio clip: rho in [1 - clip_range, 1 + clip_range] (flow_grpo: 1e-4).", gt=0)
    beta: float = f(0.04, "KL coefficient of the mean-difference term to the reference (0 = no reference).", ge=0)
    reference: Literal["auto", "model", "lora_base"] = f(
        "auto", "KL reference: the LoRA base with adapters off (auto with model.lora) or a frozen copy (model).")
    adv_clip_max: float = f(5.0, "Advantages clamped to +-adv_clip_max; 0 = off.", ge=0)
    statistics: Literal["prompt", "global"] = f(
        "prompt", "Advantage mean/std per prompt (flow_grpo's per_prompt_stat_tracking) or over the whole gathered batch.")
    global_std: bool = f(
        True, "statistics=prompt: divide by the std of every gathered reward, not the prompt group's (flow_grpo's SD3 "
        "configs: a near-flat group's noise is not blown up to +-1; flow_rtpo's image policy: false unless set, as "
        "flow_rtpo).")
    scorers: list[FlowScorerConfig] = f([], "The image rewards, e.g. [{name: shapes_colour}, {name: clip_quality, "
                                        "model: PATH, use: quality}] (the red-team scorer registry).")
    placement: Literal["local", "main"] = f(
        "main", "Where scorers run: main = rank 0 over the gathered images, each rank receiving ITS OWN values; "
        "local = every rank scores its own.")
    # the shared CVaRConfig keys (tau, w_cvar, w_quality) with Flow-GRPO's own defaults: no tail bonus, quality x 1
    w_cvar: float = f(0.0, "Weight of the CVaR tail bonus over the gathered main rewards (Flow-RTPO: 0.1).", ge=0)
    w_quality: float = f(1.0, "Weight of the quality term (the quality scorers; unused without any).")
    max_sequence_length: int = f(128, "T5 prompt tokens (flow_grpo: 128; diffusers' SD3 pipeline default: 256).",
                                 gt=0)
    ema: bool = f(False, "Keep an EMA of the trained (LoRA) weights, updated after optimizer steps (flow_grpo's "
                  "EMAModuleWrapper); evaluation and the final model use it once it has updated (before: the "
                  "trained weights); checkpoints carry it per rank.")
    ema_decay: float = f(0.9, "EMA decay d (warm-up min((1 + s) / (10 + s), d) after s optimizer steps; flow_grpo: "
                         "0.9).", gt=0, lt=1)
    ema_interval: int = f(8, "Update the EMA after optimizer step s when (s + 1) % this == 0 (flow_grpo's "
                          "update_step_interval: 8).", gt=0)
    ema_updates_per_step: int = f(
        1, "EMA updates at each such step, with the same weights (an effective decay d^n): flow_grpo steps its EMA "
        "once per training micro-batch, train.gradient_accumulation_steps times per optimizer step (2 in its "
        "32-GPU SD3 configs: 0.81; 4 in its 1- and 4-GPU ones: 0.66); 1 = the decay as written.", gt=0)

    @property
    def train_steps(self) -> int:
        """Denoising steps trained per image."""
        return max(1, int(self.num_inference_steps * self.timestep_fraction))


def flow_image_shape(cfg: RunConfig) -> ImageShape:
    """The trained forward: ``flow_grpo.resolution`` images, its prompt tokens, both CFG halves with guidance on."""
    o = cfg.section(FlowGRPOConfig)
    return ImageShape(o.resolution, o.max_sequence_length, copies=2 if o.guidance_scale > 1.0 else 1)


def flow_reference(cfg: RunConfig) -> str:
    o = cfg.section(FlowGRPOConfig)
    return resolve_reference(cfg, o.reference, needed=o.beta > 0, key="flow_grpo.reference")


class FlowGRPO(StepSeeded, OnlineAlgorithm):
    name = "flow_grpo"
    evaluate_on_every_rank = True  # a rank without eval prompts still joins the sampler's gather of the policy
    sampled_eval = False  # its evaluation is the ODE sampler's, noise seeded per prompt: no greedy / sampled pair

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        o = self.opts = cfg.section(FlowGRPOConfig)
        if not any(s.use == "main" for s in o.scorers):
            raise ConfigError("flow_grpo.scorers: name at least one main reward, e.g. [{name: shapes_colour}]")
        self.data = ImagePromptData(cfg.data)
        self.reference = flow_reference(cfg)
        #: the flow loss part on the policy (flow_rtpo builds the same on ``image_policy``)
        self.flow = FlowUpdate(o, cfg.training.seed, role="policy", reference_role="reference",
                               reference=self.reference)
        self.scorers = ScorerSet.build(o.scorers, cfg.model)
        self.step = 0  # optimizer steps done: seeds the next rollout's noise
        self.ema: ParamEMA | None = None  # flow_grpo.ema: built before training from the trained weights

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return policy_specs(cfg, flow_reference(cfg), kind="diffusion")

    @classmethod
    def image_shape(cls, cfg: RunConfig) -> ImageShape:
        return flow_image_shape(cfg)

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        super().before_training(ctx, train_set, eval_set)
        flow_policy(ctx.models["policy"])  # a one-line error for a policy of another kind
        if self.opts.ema:
            self.ema = ParamEMA(self.ema_params(ctx), decay=self.opts.ema_decay, interval=self.opts.ema_interval)
            steps = self.cfg.training.max_steps
            if steps is not None and not self.ema.updated_by(steps) and ctx.strategy.is_main:
                log.warning(f"flow_grpo.ema: {steps} optimizer steps make no EMA update (the first comes after step "
                            f"{self.ema.first_update}, ema_interval {self.opts.ema_interval}): evaluation and final/ "
                            "use the trained weights")

    # ------------------------------------------------------------------ EMA of the trained weights (models/ema.py)
    def ema_params(self, ctx: Context) -> dict[str, torch.Tensor]:
        return ctx.strategy.local_params(ctx.models["policy"])

    def on_optimizer_step(self, ctx: Context) -> None:
        if self.ema is not None:  # flow_grpo's count: the optimizer steps done (train_sd3.py's global_step)
            self.ema.after_step(self.ema_params(ctx), ctx.step, times=self.opts.ema_updates_per_step)

    def output_weights(self, ctx: Context) -> contextlib.AbstractContextManager[Any]:
        """The EMA in place of the trained weights once it has averaged any (before, it holds the warm start)."""
        if self.ema is None or not self.ema.updated_by(ctx.step):
            return contextlib.nullcontext()
        module = ctx.models["policy"]
        return self.ema.swapped(self.ema_params(ctx), lambda: ctx.strategy.refresh_params(module))

    def ema_file(self, folder: Path, ctx: Context) -> Path:
        return folder / "policy" / f"ema_rank{ctx.strategy.dp_rank}.safetensors"

    def save_files(self, folder: Path, ctx: Context) -> None:
        if self.ema is not None:
            self.ema.save(self.ema_file(folder, ctx))

    def load_files(self, folder: Path, ctx: Context) -> None:
        if self.ema is not None:
            self.ema.load(self.ema_file(folder, ctx))

    # ------------------------------------------------------------------ rollout
    def sampling_summary(self) -> str:
        return self.flow.sampling_summary()

    def scores(self, ctx: RolloutContext, prompts: list[str], images: list[Any], placement: str) -> dict[str, torch.Tensor]:
        """Every scorer's values of this rank's images (``use/name`` -> ``(n,)``), placed, not gathered."""
        batch = Judged(prompts, [""] * len(prompts), prompts, [row["fields"] for row in ctx.rows], images)
        values = self.scorers.judge(batch, ctx.strategy.device, placement)
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}

    def rollout(self, ctx: RolloutContext) -> Experience:
        o = self.opts
        prompts = [row["prompt"] for row in ctx.rows]
        drawn = self.flow.render(ctx, prompts, [f"sample:{i}" for i in range(ctx.mine.start, ctx.mine.stop)],
                                 steps=o.num_inference_steps, noise_level=o.noise_level, step=self.step)
        with ctx.timed("score"):  # time/sample_s, time/score_s: the rollout's phases
            local = self.scores(ctx, prompts, drawn.images, o.placement)
            scores = gather_scores({k: v.tolist() for k, v in local.items()})
        main, quality = self.scorers.term(scores, "main"), self.scorers.term(scores, "quality")
        assert main is not None
        terms = o.reward(main, quality)
        gathered = {"reward": terms["reward"], "reward/main": main, "cvar_bonus": terms["cvar_bonus"]}
        if quality is not None:
            gathered["reward/quality"] = quality
        gathered.update({f"reward/{k}": v for k, v in scores.items()})
        samples = self.flow.units_of(drawn, prompts)
        stats = self.make_experience(ctx, samples, [], gathered)
        for name, values in gathered.items():
            ok = values[~torch.isnan(values)]
            stats.add(f"{name}_mean" if "/" not in name else name, float(ok.mean()) if ok.numel() else math.nan, 1)
        stats.add("var", terms["var"], 1)
        return Experience(samples, gathered, stats)

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        """Advantages from the gathered ``scores["reward"]`` over each prompt's ``num_generations`` images (per
        prompt or global statistics, clamped), the same on every rank; each unit gets its image's."""
        G = self.cfg.section(RolloutConfig).num_generations
        return self.flow.experience(samples, scores["reward"], G, ctx.mine)[0]

    # ------------------------------------------------------------------ update
    def collate(self, samples: list[Sample]) -> Batch:
        return self.flow.collate(samples)

    def units(self, batch: Batch) -> int:
        return self.flow.units(batch)

    def tokens_in(self, batch: Batch) -> int:
        return 0

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        return self.flow.loss(models, batch, normalizer=normalizer)

    # ------------------------------------------------------------------ evaluation and state
    @torch.no_grad()
    def evaluate(self, ctx: RolloutContext) -> tuple[float, float, float]:
        """The eval prompts rendered by the ODE sampler (noise seeded by each prompt's index in the eval set) and
        scored on this rank: (sum of the main rewards, how many were scored, 0)."""
        rank, world = ctx.strategy.dp_rank, ctx.strategy.dp_size
        prompts = [row["prompt"] for row in ctx.rows]
        if not prompts:  # fewer eval prompts than ranks: one throwaway image, so that this rank runs the same gather
            # and forwards as the others (collectives of a sharded policy: ZeRO-3's root forward hook has one)
            self.flow.render(ctx, [self.opts.negative_prompt], ["eval:pad"], steps=self.opts.eval_num_inference_steps,
                             noise_level=0.0, step=-1)
            return 0.0, 0.0, 0.0
        keys = [f"eval:{rank + world * i}" for i in range(len(prompts))]
        images = self.flow.render(ctx, prompts, keys, steps=self.opts.eval_num_inference_steps, noise_level=0.0,
                                  step=-1).images
        main = self.scorers.term(self.scores(ctx, prompts, images, "local"), "main")
        assert main is not None
        ok = ~torch.isnan(main)
        return float(main[ok].sum()), float(ok.sum()), 0.0
