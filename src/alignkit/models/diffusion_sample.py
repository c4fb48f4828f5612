"""Sampling a flow-matching text-to-image policy and the log-probs of its transitions: what the ``diffusion`` kind's
``generate`` and ``logps`` run (:class:`~alignkit.models.kinds.DiffusionKind`). Flow-GRPO's SDE sampler with the
log-probability of every transition (``ops/flow_sde.py``), or the deterministic Euler ODE of diffusers' SD3
pipeline (evaluation, ``alignkit generate``); :func:`transition` recomputes a stored transition's step (its
log-prob, mean and noise scale) under the current weights.

A call is :class:`ImagePrompt` s (a text and its noise's generator) in and :class:`ImageGenerations` out (the
decoded images, the trajectory with its per-step log-probs, the conditioning), with :class:`FlowSampling` the
sampler's settings, as ``SamplingParams`` are a token engine's.

Noise is drawn per image from its own generator: the initial latents and every step's noise come from
``torch.randn((steps + 1, *shape), generator=g)``, so an image is the same however the batch is split over
micro-batches and ranks, and after a resume (the caller seeds the generator by run seed, step and index).
Classifier-free guidance: v = v_uncond + w (v_text - v_uncond) with the negative prompt's embeddings, one
forward over both halves (the pipeline's ``do_classifier_free_guidance``); ``guidance_scale`` <= 1 = off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from alignkit.data.batch import Batch
from alignkit.models.diffusion import FlowPolicy
from alignkit.ops.flow_sde import SDEStep, ode_step, sde_step

#: the model inputs of a batch of stored transitions (the rest are fields: ``next_latents``, ``sigma_next``,
#: ``sigma_cap``, the algorithm's ``old_logp`` and ``advantage``)
TRANSITION_INPUTS = ("latents", "sigma", "embeds", "pooled")
TRANSITION_FIELDS = ("next_latents", "sigma_next", "sigma_cap")


@dataclass(frozen=True)
class FlowSampling:
    """The sampler's settings: ``steps`` denoising steps, SDE noise level ``noise_level`` (0 = the ODE),
    classifier-free ``guidance`` (<= 1 = off) against ``negative_prompt``, ``resolution`` px square images and
    ``max_sequence_length`` T5 prompt tokens."""

    steps: int
    noise_level: float
    guidance: float
    resolution: int
    max_sequence_length: int = 77
    negative_prompt: str = ""


@dataclass(frozen=True)
class ImagePrompt:
    """One image to draw: its prompt ``text`` and the ``generator`` of its noise (seeded by the caller)."""

    text: str
    generator: torch.Generator


@dataclass
class Conditioning:
    """``embeds`` ``(B, L, D)`` / ``pooled`` ``(B, P)`` of the prompts and, with guidance, ``neg_embeds`` /
    ``neg_pooled`` of the negative prompt (same shapes)."""

    embeds: Tensor
    pooled: Tensor
    neg_embeds: Tensor | None = None
    neg_pooled: Tensor | None = None


@dataclass
class Trajectory:
    """``latents`` ``(B, N + 1, C, h, w)`` (the start noise, then every step's result), ``logps`` ``(B, N)``
    (zeros for the ODE), ``sigmas`` ``(N + 1,)`` the schedule (last 0) and ``sigma_cap`` (the schedule's
    second sigma: flow_grpo's stand-in for sigma = 1 under the noise scale's root)."""

    latents: Tensor
    logps: Tensor
    sigmas: Tensor
    sigma_cap: float


def schedule(scheduler: Any, steps: int) -> Tensor:
    """``(steps + 1,)`` noise levels of the pipeline's flow-matching scheduler for ``steps`` denoising steps,
    from 1 down to 0 (the scheduler's ``set_timesteps``, as the SD3 pipeline's ``retrieve_timesteps``)."""
    if getattr(scheduler.config, "use_dynamic_shifting", False):
        raise ValueError("the pipeline's scheduler uses dynamic shifting (a resolution-dependent mu), which the "
                         "flow sampler does not compute: use a scheduler with a fixed shift")
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.detach().float().cpu().clone()


def velocity(module: nn.Module, latents: Tensor, sigma: Tensor, cond: Conditioning, *, guidance: float,
             scale: float, detach_uncond: bool = False) -> Tensor:
    """``(B, C, h, w)`` the (guided) velocity at ``latents`` and noise levels ``sigma`` ``(B,)``; ``scale``: the
    transformer's timestep per unit sigma (the scheduler's ``num_train_timesteps``). ``detach_uncond``: the
    unconditional half carries no gradient (flow_grpo's training forward). The latents enter in the text
    embeddings' dtype (the pipeline's); the velocity comes back in the transformer's."""
    latents = latents.to(cond.embeds.dtype)  # fp32 trajectories into a bf16 / fp16 transformer
    # the timestep stays fp32, as diffusers' SD3 pipeline and flow_grpo pass it (its sinusoidal embedding is
    # computed in fp32): in bf16, 913.35 would become 916 and the model would be conditioned on another time
    t = sigma.to(device=latents.device, dtype=torch.float32) * scale
    if guidance <= 1.0 or cond.neg_embeds is None:
        return module(latents, t, cond.embeds, cond.pooled)
    both = module(torch.cat([latents, latents]), torch.cat([t, t]), torch.cat([cond.neg_embeds, cond.embeds]),
                  torch.cat([cond.neg_pooled, cond.pooled]))
    uncond, text = both.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance * (text - uncond)


def latent_shape(flow: Any, resolution: int) -> tuple[int, int, int]:
    """``(C, h, w)`` of a ``resolution`` px square image's latents."""
    factor = int(getattr(flow.pipe, "vae_scale_factor", 8))
    if resolution % factor:
        raise ValueError(f"resolution {resolution} is not a multiple of the VAE's downsampling ({factor})")
    return (int(flow.transformer.config.in_channels), resolution // factor, resolution // factor)


@torch.no_grad()
def sample(module: nn.Module, cond: Conditioning, generators: list[torch.Generator], *, shape: tuple[int, ...],
           sigmas: Tensor, guidance: float, noise_level: float, scale: float) -> Trajectory:
    """Denoise one image per generator from pure noise along ``sigmas``: SDE steps with log-probs when
    ``noise_level`` > 0, else ODE (Euler) steps. ``module`` is the policy (a FlowPolicy, or its engine wrapper)."""
    device = cond.embeds.device
    steps = sigmas.numel() - 1
    draws = torch.stack([torch.randn((steps + 1, *shape), generator=g) for g in generators]).to(device)
    x = draws[:, 0]
    B, cap = x.shape[0], float(sigmas[1]) if steps > 1 else 0.0
    latents, logps = [x], []
    for i in range(steps):
        s, s_next = sigmas[i].expand(B).to(device), sigmas[i + 1].expand(B).to(device)
        v = velocity(module, x, s, cond, guidance=guidance, scale=scale)
        if noise_level > 0:
            out = sde_step(v, x, s, s_next, noise_level=noise_level, sigma_cap=cap, noise=draws[:, i + 1])
            x, lp = out.sample, out.logp
        else:
            x, lp = ode_step(v, x, s, s_next), torch.zeros(B, device=device)
        latents.append(x)
        logps.append(lp)
    return Trajectory(torch.stack(latents, dim=1), torch.stack(logps, dim=1), sigmas, cap)


@torch.no_grad()
def decode(flow: Any, latents: Tensor) -> list[Any]:
    """PIL images of final ``(B, C, h, w)`` latents (SD3's unscale and shift, the VAE, the image processor)."""
    vae = flow.pipe.vae
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    x = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + shift
    images = vae.decode(x, return_dict=False)[0]
    return flow.pipe.image_processor.postprocess(images, output_type="pil")


@dataclass
class ImageGenerations:
    """One image per prompt, in order: ``images`` (PIL), the ``trajectory`` that drew them and the ``cond`` itioning."""

    images: list[Any]
    trajectory: Trajectory
    cond: Conditioning


def flow_policy(module: nn.Module) -> Any:
    """The :class:`~alignkit.models.diffusion.FlowPolicy` inside an engine's wrapper (DDP / DeepSpeed ``.module``):
    its frozen encoders run outside the wrapper (they hold none of the trained parameters)."""
    while not isinstance(module, FlowPolicy):
        inner = getattr(module, "module", None)
        if inner is None:
            raise TypeError(f"a diffusion model (model.kind: diffusion) was expected, got {type(module).__name__}")
        module = inner
    return module


def conditioning(flow: Any, embeds: Tensor, pooled: Tensor, params: FlowSampling) -> Conditioning:
    """The prompts' embeddings with, under guidance, the negative prompt's (encoded once: ``FlowPolicy.negative``)
    expanded to their batch."""
    if params.guidance <= 1.0:
        return Conditioning(embeds, pooled)
    neg, neg_pooled = flow.negative(params.negative_prompt, params.max_sequence_length)
    n = embeds.shape[0]
    return Conditioning(embeds, pooled, neg.expand(n, *neg.shape[1:]), neg_pooled.expand(n, *neg_pooled.shape[1:]))


def generate(module: nn.Module, prompts: Sequence[ImagePrompt], params: FlowSampling) -> ImageGenerations:
    """Draw one image per prompt with ``module`` (the plain policy, or its engine wrapper): SDE steps with their
    log-probs when ``params.noise_level`` > 0, else the ODE; decoded by the pipeline's VAE."""
    flow = flow_policy(module)
    embeds, pooled = flow.encode_text([p.text for p in prompts], params.max_sequence_length)
    cond = conditioning(flow, embeds, pooled, params)
    traj = sample(module, cond, [p.generator for p in prompts], shape=latent_shape(flow, params.resolution),
                  sigmas=schedule(flow.pipe.scheduler, params.steps), guidance=params.guidance,
                  noise_level=params.noise_level, scale=float(flow.pipe.scheduler.config.num_train_timesteps))
    return ImageGenerations(decode(flow, traj.latents[:, -1]), traj, cond)


def transition_units(gens: ImageGenerations, steps: int) -> list[dict[str, Any]]:
    """The stored transitions of the first ``steps`` denoising steps of every image, step-major (one step of
    several images in a micro-batch, as flow_grpo's): :data:`TRANSITION_INPUTS` and :data:`TRANSITION_FIELDS`,
    ``logp`` the sampler's, ``image`` its index. Tensors stay where the sampler left them."""
    traj, cond = gens.trajectory, gens.cond
    cap = torch.tensor(traj.sigma_cap, dtype=torch.float32)
    return [{"latents": traj.latents[i, j], "next_latents": traj.latents[i, j + 1], "sigma": traj.sigmas[j],
             "sigma_next": traj.sigmas[j + 1], "sigma_cap": cap, "logp": traj.logps[i, j], "embeds": cond.embeds[i],
             "pooled": cond.pooled[i], "image": i}
            for j in range(steps) for i in range(traj.latents.shape[0])]


def transition_batch(units: Sequence[dict[str, Any]], fields: Sequence[str] = ()) -> Batch:
    """Units of :func:`transition_units` stacked: :data:`TRANSITION_INPUTS` declared model inputs, the
    transition's own fields and the caller's ``fields`` (``old_logp``, ``advantage``, ...) fields."""
    def stack(keys: Sequence[str]) -> dict[str, Tensor]:
        return {k: torch.stack([u[k] for u in units]) for k in keys}

    return Batch(stack(TRANSITION_INPUTS), stack([*TRANSITION_FIELDS, *fields]))


def transition(module: nn.Module, batch: Batch, params: FlowSampling) -> SDEStep:
    """The SDE step of the batch's stored transitions under ``module`` (the policy, or its LoRA-off base):
    the log-prob of each stored next latent, the step's mean and noise scale. The unconditional half of a
    guided velocity carries no gradient (flow_grpo's training forward)."""
    flow = flow_policy(module)
    cond = conditioning(flow, batch["embeds"], batch["pooled"], params)
    v = velocity(module, batch["latents"], batch["sigma"], cond, guidance=params.guidance,
                 scale=float(flow.pipe.scheduler.config.num_train_timesteps), detach_uncond=True)
    return sde_step(v, batch["latents"], batch["sigma"], batch["sigma_next"], noise_level=params.noise_level,
                    sigma_cap=batch["sigma_cap"], next_sample=batch["next_latents"])
