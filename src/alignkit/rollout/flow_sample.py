"""Sampling a flow-matching text-to-image policy (the ``diffusion`` kind): Flow-GRPO's SDE sampler with the
log-probability of every transition (``ops/flow_sde.py``), or the deterministic Euler ODE of diffusers' SD3
pipeline (evaluation, ``alignkit generate``).

Noise is drawn per image from its own generator: the initial latents and every step's noise come from
``torch.randn((steps + 1, *shape), generator=g)``, so an image is the same however the batch is split over
micro-batches and ranks, and after a resume (the caller seeds the generator by run seed, step and index).
Classifier-free guidance: v = v_uncond + w (v_text - v_uncond) with the negative prompt's embeddings, one
forward over both halves (the pipeline's ``do_classifier_free_guidance``); ``guidance_scale`` <= 1 = off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from alignkit.ops.flow_sde import ode_step, sde_step


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
