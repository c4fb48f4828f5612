"""Flow-RTPO (``algorithm: flow_rtpo``; ALGORITHMS 2, henrymao2004/flow_rtpo): the red-team attacker AND the
flow-matching image policy trained together from one reward, in one run of the online loop.

Roles: ``policy`` is the attacker (an LM, ``model:``, full or LoRA; its KL reference ``reference``),
``image_policy`` the flow policy (``flow_rtpo.image_model``, kind ``diffusion``, LoRA ``flow_rtpo.image_lora``;
its KL reference ``image_reference``, the LoRA base), ``target`` the frozen VLM of ``redteam.target`` (name
``t2i_vlm``). Each trained role has its own optimizer, LR schedule and checkpoint folder (``checkpoint-N/policy``,
``checkpoint-N/image_policy``; ``final/`` and ``final_image_policy/``); the loop steps both after every update.

Per iteration (``rollout.num_generations`` attacks per seed prompt, groups contiguous in global order):

1. the attacker rewrites (``redteam.mode``) each seed prompt of this rank;
2. the image policy renders every attack ``flow_rtpo.images_per_attack`` times (the reference's
   ``num_image_per_prompt``) with Flow-GRPO's SDE sampler (``flow_grpo.num_inference_steps``, noise seeded by
   (seed, step, the image's global index): ``algorithms/flow_grpo.py``), keeping the trajectories and their
   log-probs; this is the red-team ``t2i_vlm`` target's renderer, so the frozen VLM answers each of THESE images;
3. ``redteam.scorers`` read each image's VLM text (toxicity) and the image with its attack (``clip_quality``),
   placed as ``redteam.placement`` says, gathered in global order;
4. two rewards over the GATHERED images (``rewards/cvar.py``): the attacker's R_a = tox + w_cvar
   max(0, tox - VaR_tau) + w_quality q - w_diversity sim (``redteam:``), an attack's the mean over its images,
   and the image policy's R_i = tox + w_cvar max(0, tox - VaR_tau) + w_quality q_img (``flow_grpo.tau`` /
   ``w_cvar`` / ``w_quality``, each the attacker's unless set; q_img only from the quality scorers the image can
   change: ``depends_on_image``); the attacker's advantages per seed prompt (``redteam.statistics``), the image
   policy's per attack (``flow_grpo.statistics: prompt``; its images share one conditioning, so the advantage
   says how good THIS image was, not which attack it drew; per seed prompt at 1 image per attack) or global,
   identical on every rank;
5. one update: the attacker's samples (GRPO's loss, ``grpo:``) then the (image, denoising step) units (Flow-GRPO's
   loss); a micro-batch's loss is ``{role: loss}`` and each role is normalised by its OWN global unit count
   (``train/step.py`` ``role_normalizers``).

Logged: the attacker's terms as redteam logs them (``reward_mean``, ``toxicity_mean``, ``cvar_bonus_mean``,
``quality_mean``, ``var``, ``attack_success_rate``, ``kl``, ...) and the image policy's under ``image/``
(``image/reward_mean``, ``image/cvar_bonus_mean``, ``image/quality_mean``, ``image/var``, ``image/advantage_std``,
``image/kl``, ``image/ratio``, ...), with ``loss/image_policy`` and ``grad_norm/image_policy``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from alignkit.algorithms.base import Batch, Context, Example, policy_specs
from alignkit.algorithms.flow_grpo import FlowGRPOConfig, flow_image_shape
from alignkit.algorithms.flow_update import FlowUpdate
from alignkit.algorithms.grpo import grpo_reference
from alignkit.algorithms.redteam import RedTeam, RedTeamConfig
from alignkit.config.loader import given_keys
from alignkit.config.schema import LoraConfig, RunConfig, f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError
from alignkit.metrics import MetricSums
from alignkit.models.diffusion_render import BUILTIN_SHAPES
from alignkit.models.diffusion_sample import TRANSITION_INPUTS, flow_policy
from alignkit.models.roles import ImageShape, Models, ModelSpec
from alignkit.rewards.cvar import CVaRConfig
from alignkit.rewards.scorers import Judged, depends_on_image
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample
from alignkit.rollout.redteam_targets import build_target

IMAGE = "image/"  # the prefix of the image policy's batch fields and metrics


@register_section("flow_rtpo")
@dataclass
class FlowRTPOConfig:
    """``algorithm: flow_rtpo``: the image policy trained with the attacker (module docstring). The attacker is
    ``model:`` with ``redteam:`` and ``grpo:``; the image policy's sampler, loss and reward weights are ``flow_grpo:``."""

    image_model: str = f("", "The flow-matching text-to-image policy (diffusers pipeline directory or hub id, SD3 "
                         "class), trained alongside the attacker.")
    image_lora: Optional[LoraConfig] = f(None, "LoRA on the image policy's transformer (its KL reference is then the "
                                         "LoRA base); null = the whole transformer trains.")
    image_learning_rate: Optional[float] = f(None, "Peak learning rate of the image policy's optimizer (scaled with the "
                                             "global batch as training.learning_rate is); null = training.learning_rate.", gt=0)
    images_per_attack: int = f(4, "Images the image policy renders of each attack (the reference's num_image_per_prompt), "
                               "each answered by the VLM and scored; the image policy's advantages are grouped by "
                               "attack (flow_grpo.statistics: prompt), the attacker's reward is the mean over its "
                               "images. 1 = one image per attack, the image policy grouped by seed prompt.", gt=0)


#: the image policy's reward fields that are the attacker's (``redteam.<name>``) unless ``flow_grpo`` sets them:
#: flow_grpo's own defaults (w_cvar 0, w_quality 1) would give it no tail bonus and 20x the attacker's quality weight
ATTACKER_DEFAULTS = tuple(x.name for x in dataclasses.fields(CVaRConfig))  # tau, w_cvar, w_quality
#: and the reference's own for its image policy (per-group std) unless set
IMAGE_DEFAULTS = {"global_std": False}


def inherit_image_defaults(cfg: RunConfig) -> None:
    """Fill the ``flow_grpo`` fields the config did not set (``given_keys``) with the image policy's defaults inside
    flow_rtpo, in place, so the resolved config (config.yaml, a resume's comparison) holds what trains."""
    fg, rt = cfg.section(FlowGRPOConfig), cfg.section(RedTeamConfig)
    given = given_keys(fg)
    for name in ATTACKER_DEFAULTS:
        if name not in given:
            setattr(fg, name, getattr(rt, name))
    for name, value in IMAGE_DEFAULTS.items():
        if name not in given:
            setattr(fg, name, value)


def image_reference(cfg: RunConfig) -> str:
    """The image policy's KL reference: none at flow_grpo.beta 0, its LoRA base with image_lora, else a frozen copy."""
    if cfg.section(FlowGRPOConfig).beta == 0:
        return "none"
    return "lora_base" if cfg.section(FlowRTPOConfig).image_lora is not None else "model"


class FlowRTPO(RedTeam):
    name = "flow_rtpo"
    config_sections = ("flow_grpo",)  # the image policy's sampler, loss and reward weights

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        check_config(cfg)
        super().__init__(cfg, tokenizer)
        #: Flow-GRPO's flow loss part on the image policy
        self.image = FlowUpdate(cfg.section(FlowGRPOConfig), cfg.training.seed, role="image_policy",
                                reference_role="image_reference", reference=image_reference(cfg))
        self.answers_per_attack = cfg.section(FlowRTPOConfig).images_per_attack  # the VLM answers each image
        self.image_step = 0  # optimizer steps done: seeds the next rollout's image noise

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        super().check_config(cfg)
        check_config(cfg)

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        check_config(cfg)
        fr = cfg.section(FlowRTPOConfig)
        attacker = policy_specs(cfg, grpo_reference(cfg))
        scale = fr.image_learning_rate / cfg.training.learning_rate if fr.image_learning_rate else 1.0
        image = [ModelSpec("image_policy", fr.image_model, "diffusion", trainable=True, lora=fr.image_lora is not None,
                           lora_config=fr.image_lora, lr_scale=scale)]
        ref = image_reference(cfg)
        if ref == "lora_base":
            image.append(ModelSpec("image_reference", fr.image_model, "diffusion", shares="image_policy"))
        elif ref == "model":
            image.append(ModelSpec("image_reference", fr.image_model, "diffusion"))
        specs = [*attacker, *image, *build_target(cfg.section(RedTeamConfig).target).specs()]
        return [s for s in specs if s.trainable] + [s for s in specs if not s.trainable]  # trained roles first

    @classmethod
    def image_shape(cls, cfg: RunConfig) -> ImageShape:
        return flow_image_shape(cfg)

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        super().before_training(ctx, train_set, eval_set)
        flow_policy(ctx.models["image_policy"])

    def sampling_summary(self) -> str:
        return f"attacker: {super().sampling_summary()}; image policy: {self.image.sampling_summary()}"

    # ------------------------------------------------------------------ rollout
    def rollout(self, ctx: RolloutContext) -> Experience:
        """The attacker's attacks, each rendered ``images_per_attack`` times by the image policy (SDE samples with
        their log-probs) and answered by the VLM target on each image (one row per image, an attack's contiguous);
        the attacker's experience (``RedTeam.experience``), then the image policy's reward, advantages and (image,
        step) units from the same gathered scores. The drawn images live in this call alone."""
        gens, samples = self.attacks(ctx)
        o, k = self.image.opts, self.answers_per_attack
        shown = [a for a in (t.strip() for t in gens.texts) for _ in range(k)]
        keys = [f"sample:{i}" for i in range(ctx.mine.start * k, ctx.mine.stop * k)]  # the image's global index
        start = time.perf_counter()
        drawn = self.image.render(ctx, shown, keys, steps=o.num_inference_steps, noise_level=o.noise_level,
                                  step=self.image_step)
        sample_s = time.perf_counter() - start
        exp = self.experience(ctx, gens, samples, self.shown_to_target(ctx, shown, drawn.images, k))
        return self.with_image_policy(ctx, exp, self.image.units_of(drawn, shown), sample_s)

    def shown_to_target(self, ctx: RolloutContext, shown: list[str], images: list[Any], k: int) -> Judged:
        """The VLM target's answers to each attack of ``shown`` on its image (``k`` rows per row of ``ctx.rows``)."""
        seeds = [row["prompt"] for row in ctx.rows for _ in range(k)]
        fields = [row["fields"] for row in ctx.rows for _ in range(k)]
        outputs = self.target.respond(ctx, shown, seeds, fields, images=images)
        return Judged(shown, outputs, seeds, fields, images)

    def eval_answers(self, ctx: RolloutContext, attacks: list[str]) -> Judged:
        """Greedy attacks drawn once each by the image policy's ODE sampler (noise seeded by each attack's index in
        the eval set), answered by the VLM target."""
        rank, world = ctx.strategy.dp_rank, ctx.strategy.dp_size
        keys = [f"eval:{rank + world * i}" for i in range(len(attacks))]
        images = self.image.render(ctx, attacks, keys, steps=self.image.opts.eval_num_inference_steps,
                                   noise_level=0.0, step=-1).images
        return self.shown_to_target(ctx, attacks, images, 1)

    def with_image_policy(self, ctx: RolloutContext, exp: Experience, units: list[Sample],
                          sample_s: float) -> Experience:
        """``exp`` with the image policy's ``units`` (their advantages from its reward over the gathered scores),
        its statistics under ``image/`` and its reward and advantage in the records (attacks.jsonl)."""
        tox, quality = exp.scores["toxicity"], self.image_quality(exp.scores)
        terms = self.image.opts.reward(tox, quality)
        group, mine = self.image_groups(ctx)
        stats, adv = self.image.experience(units, terms["reward"], group, mine)
        for k, v in stats.means().items():
            exp.stats.add(IMAGE + k, v, 1)
        for k in ("reward", "cvar_bonus", "quality"):
            values = terms[k]
            ok = values[~torch.isnan(values)]
            exp.stats.add(f"{IMAGE}{k}_mean", float(ok.mean()) if ok.numel() else math.nan, 1)
        exp.stats.add(IMAGE + "var", terms["var"], 1)
        exp.stats.add(IMAGE + "sample_s", sample_s, 1)
        exp.scores[IMAGE + "reward"] = terms["reward"]
        for i, row in enumerate(exp.records):  # attacks.jsonl: the image policy's reward and advantage too
            row["image_reward"], row["image_advantage"] = float(terms["reward"][i]), float(adv[i])
        return Experience(exp.samples + units, exp.scores, exp.stats, exp.records)

    def image_groups(self, ctx: RolloutContext) -> tuple[int, slice]:
        """(images per advantage group, this rank's slice of the gathered images): one attack's images
        (contiguous), or at one image per attack a seed prompt's ``num_generations``; this rank's images are those
        of its attacks."""
        k = self.answers_per_attack
        group = k if k > 1 else self.cfg.section(RolloutConfig).num_generations
        return group, slice(ctx.mine.start * k, ctx.mine.stop * k)

    def image_quality(self, scores: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The quality term of the image policy's reward: only the quality scorers whose value the image can
        change (``depends_on_image``: clip_quality, not fluency or seed_similarity of the attack, which would only
        add the attacker's noise to its advantages); None when there is none."""
        return self.scorers.where(depends_on_image).term(scores, "quality")

    # ------------------------------------------------------------------ update
    def collate(self, samples: list[dict[str, Any]]) -> Batch:
        """A micro-batch of the attacker's samples (GRPO's layout) and/or the image units (fields ``image/...``)."""
        attacks = [s for s in samples if "completion_ids" in s]
        units = [s for s in samples if "latents" in s]
        batch = super().collate(attacks) if attacks else Batch()
        if units:
            batch.update({IMAGE + k: v for k, v in self.image.collate(units).items()})
        return batch

    @staticmethod
    def image_part(batch: Batch) -> Batch | None:
        """The image units of a micro-batch, their transition inputs declared again (in the merged batch every
        ``image/`` key is a field: none may reach the attacker's forward)."""
        part = {k[len(IMAGE):]: v for k, v in batch.items() if k.startswith(IMAGE)}
        if not part:
            return None
        return Batch({k: part.pop(k) for k in TRANSITION_INPUTS}, part)

    def units(self, batch: Batch) -> dict[str, int]:  # type: ignore[override]
        image = self.image_part(batch)
        return {"policy": super().units(batch) if "input_ids" in batch else 0,
                "image_policy": self.image.units(image) if image is not None else 0}

    def tokens_in(self, batch: Batch) -> int:
        return super().tokens_in(batch) if "input_ids" in batch else 0

    def loss(self, models: Models, batch: Batch, *, normalizer: float | dict[str, float]) -> tuple[dict[str, torch.Tensor], MetricSums]:  # type: ignore[override]
        if not isinstance(normalizer, dict):
            raise TypeError("flow_rtpo's loss needs a normaliser per role (units() returns one count per role)")
        losses, m = {}, MetricSums()
        if "input_ids" in batch:
            losses["policy"], m = super().loss(models, batch, normalizer=normalizer["policy"])
        image = self.image_part(batch)
        if image is not None:
            losses["image_policy"], parts = self.image.loss(models, image, normalizer=normalizer["image_policy"])
            for k in parts.sums:
                m.add(IMAGE + k, parts.sums[k], parts.counts[k])
        return losses, m

    # ------------------------------------------------------------------ state
    def on_step_end(self, ctx: Context) -> dict[str, float]:
        self.image_step = ctx.step  # seeds the next rollout's image noise
        return super().on_step_end(ctx)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "image_step": self.image_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.image_step = int(state.get("image_step", 0))


def check_config(cfg: RunConfig) -> None:
    """flow_rtpo's cross-section rules, each a one-line error naming its key; first the image policy's defaults
    (:func:`inherit_image_defaults`)."""
    inherit_image_defaults(cfg)
    fr, rt, fg = cfg.section(FlowRTPOConfig), cfg.section(RedTeamConfig), cfg.section(FlowGRPOConfig)
    if not fr.image_model:
        raise ConfigError("flow_rtpo.image_model: name the image policy (a diffusers pipeline directory or hub id)")
    if rt.target.name != "t2i_vlm":
        raise ConfigError(f"redteam.target.name: flow_rtpo renders the attacks with its image policy for a VLM: it "
                          f"needs t2i_vlm (have {rt.target.name!r})")
    if rt.target.renderer != BUILTIN_SHAPES:
        raise ConfigError(f"redteam.target.renderer: flow_rtpo's renderer is its trained image policy "
                          f"(flow_rtpo.image_model); leave the renderer unset (have {rt.target.renderer!r})")
    if fg.ema:
        raise ConfigError("flow_grpo.ema: the EMA of the LoRA weights is flow_grpo's; flow_rtpo does not keep one")
    if fg.scorers:
        raise ConfigError("flow_grpo.scorers: flow_rtpo scores with redteam.scorers (toxicity on the VLM's text, "
                          "clip_quality on the images); leave flow_grpo.scorers empty")
    if cfg.model.kind not in ("auto", "lm"):
        raise ConfigError(f"model.kind: the flow_rtpo attacker is an lm (have {cfg.model.kind!r}); the image policy "
                          f"is flow_rtpo.image_model")
