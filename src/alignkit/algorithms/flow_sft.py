"""Flow-matching fine-tuning of a text-to-image pipeline (``algorithm: flow_sft``) on image/caption rows.

The rectified-flow loss SD3 trains with (``losses/flow.py``): each image's latents x0 (the pipeline's VAE) are
mixed with noise at a sampled noise level sigma and the transformer, conditioned on the caption (the
pipeline's text encoders), regresses the velocity noise - x0. The policy is a ``diffusion`` model
(``models/diffusion.py``: the transformer trains, in full or through LoRA with ``model.lora``). So the tiny
pipeline (``alignkit tiny-model OUT --arch sd3``) first learns to draw the shipped synthetic scenes
(``alignkit data synth --kind vlm --stage pretrain``), and a user fine-tunes a real one.

Noise and sigma of an image are drawn from a generator seeded by (``training.seed``, the optimizer step, the
row's file name and line): the same however the step is split over micro-batches and ranks, again after a resume
(the step is the algorithm's state), and wherever the data lies (the file's folder is not part of the seed). Evaluation draws with step -1: every evaluation of a run sees the
same noise, so its losses compare.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

from alignkit.algorithms.base import Context, OfflineAlgorithm, policy_specs
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.batch import Batch
from alignkit.data.captions import CaptionData
from alignkit.losses.flow import flow_matching_loss, noisy_latents, sample_sigmas
from alignkit.metrics import MetricSums
from alignkit.models.diffusion_sample import flow_policy
from alignkit.models.roles import ImageShape, Models, ModelSpec


@register_section("flow_sft")
@dataclass
class FlowSFTConfig:
    resolution: int = f(32, "Side of the square training images in pixels (each image is resized to it); a "
                        "multiple of the VAE's downsampling x the transformer's patch size.", gt=0)
    timestep_sampling: Literal["logit_normal", "uniform"] = f(
        "logit_normal", "How the noise level sigma of each image is drawn: logit_normal (SD3's: sigmoid of "
        "N(logit_mean, logit_std)) or uniform in (0, 1).")
    logit_mean: float = f(0.0, "logit_normal: mean of the normal before the sigmoid.")
    logit_std: float = f(1.0, "logit_normal: std of the normal before the sigmoid.", gt=0)
    max_sequence_length: int = f(77, "Prompt tokens of the T5 encoder (SD3's max_sequence_length; a pipeline "
                                 "without T5 gets this many zero embeddings in its place).", gt=0)
    cache_encodings: bool = f(False, "Keep each image's latents and its caption's embeddings (the frozen VAE's and "
                              "text encoders' outputs, the same every epoch) in host memory after their first use, so "
                              "later epochs run only the transformer (diffusers' cache_latents). Costs latents + text "
                              "embeddings per row (SD3 at 1024 px, 256 T5 tokens: about 6 MB a row in fp32): for small "
                              "data sets trained for many epochs.")


def seeded(seed: int, step: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{step}:{key}".encode()))


class StepSeeded:
    """State of an algorithm whose noise is seeded by the optimizer step (``seeded``): ``step``, the optimizer
    steps done, kept by the hook and carried by checkpoints, so a resumed run draws the same noise."""

    step: int = 0

    def on_step_end(self, ctx: Context) -> dict[str, float]:
        self.step = ctx.step
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))


class FlowSFT(StepSeeded, OfflineAlgorithm):
    name = "flow_sft"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.opts = cfg.section(FlowSFTConfig)
        self.cached: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # key -> latents, embeds, pooled
        # with the cache, the collator reads no image whose latents are held (every step after the first epoch)
        encoded = self.cached if self.opts.cache_encodings else None
        super().__init__(cfg, tokenizer, CaptionData(cfg.data, self.opts.resolution, encoded=encoded))
        self.step = 0  # optimizer steps done: seeds the noise of the next one

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        return policy_specs(cfg, "none", kind="diffusion")

    @classmethod
    def image_shape(cls, cfg: RunConfig) -> ImageShape:
        o = cfg.section(FlowSFTConfig)
        return ImageShape(o.resolution, o.max_sequence_length)

    def draws(self, keys: list[str], shape: torch.Size, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, *shape)`` noise and ``(B,)`` sigmas, one seeded generator per image (module docstring)."""
        o, noise, sigmas = self.opts, [], []
        for key in keys:
            gen = seeded(self.cfg.training.seed, step, key)
            sigmas.append(sample_sigmas(1, gen, scheme=o.timestep_sampling, mean=o.logit_mean, std=o.logit_std))
            noise.append(torch.randn(shape, generator=gen))
        return torch.stack(noise), torch.cat(sigmas)

    @torch.no_grad()
    def encodings(self, flow: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's ``(B, C, h, w)`` latents and ``(B, L, D)`` / ``(B, P)`` caption embeddings from the frozen
        encoders, or, with ``cache_encodings``, from the cache for the rows seen before (keyed by row)."""
        if not self.opts.cache_encodings:
            embeds, pooled = flow.encode_text(batch["captions"], self.opts.max_sequence_length)
            return flow.encode_images(batch["pixels"]), embeds, pooled
        keys = batch["keys"]
        new = [i for i, k in enumerate(keys) if k not in self.cached]
        if new:  # batch["pixels"] holds the images of the rows not held when it was collated (pixel_keys), a superset
            row = {k: j for j, k in enumerate(batch["pixel_keys"])}
            x0 = flow.encode_images(batch["pixels"][[row[keys[i]] for i in new]])
            embeds, pooled = flow.encode_text([batch["captions"][i] for i in new], self.opts.max_sequence_length)
            for j, i in enumerate(new):
                self.cached[keys[i]] = (x0[j].cpu(), embeds[j].cpu(), pooled[j].cpu())
        x0, embeds, pooled = (torch.stack([self.cached[k][part] for k in keys]).to(flow.transformer.device)
                              for part in range(3))
        return x0, embeds, pooled

    def losses(self, models: Models, batch: Batch, step: int, normalizer: float) -> tuple[torch.Tensor, torch.Tensor]:
        module = models["policy"]
        flow = flow_policy(module)
        x0, embeds, pooled = self.encodings(flow, batch)
        noise, sigmas = self.draws(batch["noise_keys"], x0.shape[1:], step)
        noise, sigmas = noise.to(x0), sigmas.to(x0)
        scale = flow.pipe.scheduler.config.num_train_timesteps  # the transformer's timestep = sigma x 1000
        velocity = module(noisy_latents(x0, noise, sigmas), sigmas * scale, embeds, pooled)
        return flow_matching_loss(velocity, x0, noise, normalizer=normalizer)

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        loss, per_image = self.losses(models, batch, self.step, normalizer)
        m = MetricSums()
        m.add_mean("flow_loss", per_image)
        return loss, m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        _, per_image = self.losses(models, batch, -1, 1.0)
        m = MetricSums()
        m.add_mean("loss", per_image)
        return m
