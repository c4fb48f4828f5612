"""Rectified-flow / flow-matching training of a velocity model, as SD3 trains (Esser et al., arXiv 2403.03206).

With clean latents x0, noise eps ~ N(0, I) and sigma in (0, 1): x_sigma = (1 - sigma) x0 + sigma eps (eq. 1 of the
rectified-flow forward process), whose velocity d x_sigma / d sigma = eps - x0 is the model's regression target.
"""

from __future__ import annotations

import torch
from torch import Tensor


def noisy_latents(x0: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """``(1 - sigma) x0 + sigma noise`` per sample; ``sigmas`` ``(B,)``, ``x0`` / ``noise`` ``(B, ...)``."""
    s = sigmas.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - s) * x0 + s * noise


def flow_matching_loss(velocity: Tensor, x0: Tensor, noise: Tensor, *, normalizer: float) -> tuple[Tensor, Tensor]:
    """``(sum over samples of mean_elements (v - (noise - x0))^2) / normalizer`` and the ``(B,)`` per-sample means.

    Args:
        velocity: ``(B, ...)`` the model's prediction at ``noisy_latents(x0, noise, sigma)``.
        x0, noise: ``(B, ...)`` the clean latents and the noise they were mixed with.
        normalizer: images of the WHOLE optimizer step (all micro-batches, all ranks) / ``dp_size`` (ALGORITHMS 6.1).
    """
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (global images / dp_size), got {normalizer}")
    target = noise - x0
    per_sample = (velocity.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    return per_sample.sum() / normalizer, per_sample.detach()


def sample_sigmas(n: int, generator: torch.Generator, *, scheme: str = "logit_normal", mean: float = 0.0,
                  std: float = 1.0) -> Tensor:
    """``(n,)`` training noise levels in (0, 1): ``logit_normal`` (SD3's default: sigmoid of N(mean, std)) or
    ``uniform``."""
    if scheme == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator) * std + mean)
    if scheme == "uniform":
        return torch.rand(n, generator=generator).clamp(1e-4, 1 - 1e-4)
    raise ValueError(f"unknown timestep sampling {scheme!r} (logit_normal | uniform)")



def flow_grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_range: float, normalizer: float,
                   mean: Tensor | None = None, ref_mean: Tensor | None = None, std_t: Tensor | None = None,
                   beta: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-GRPO's loss (ALGORITHMS 2.4; yifan123/flow_grpo ``scripts/train_sd3.py``) over ``(B,)`` transitions,
    each one (image, denoising step) pair:

    * rho = exp(logp - old_logp); policy term = max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range));
    * KL term (``beta`` > 0, with ``mean`` / ``ref_mean`` ``(B, ...)`` the SDE step's mean under the policy and
      under the reference, and ``std_t`` ``(B,)``): mean_elements((mean - ref_mean)^2) / (2 std_t^2), flow_grpo's
      form: this term equals the Gaussian KL of the transition times (-dt), since the transition's variance is
      std_t^2 (-dt) (std_t is the noise scale, not the transition's std);
    * loss = sum over the pairs of (policy + beta KL) / ``normalizer`` (pairs of the WHOLE optimizer step / dp_size).

    Returns the loss and ``(B,)`` detached per-pair values: ``policy``, ``kl`` (zeros without a reference),
    ``ratio``, ``clipped`` (1 where |rho - 1| > clip_range, flow_grpo's clipfrac)."""
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (global pairs / dp_size), got {normalizer}")
    ratio = torch.exp(logp.float() - old_logp.float())
    adv = advantages.float()
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    per_pair = policy
    kl = torch.zeros_like(policy)
    if beta > 0:
        if mean is None or ref_mean is None or std_t is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std_t")
        kl = (mean.float() - ref_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * std_t.float() ** 2)
        per_pair = policy + beta * kl
    parts = {"policy": policy.detach(), "kl": kl.detach(), "ratio": ratio.detach(),
             "clipped": ((ratio.detach() - 1.0).abs() > clip_range).float()}
    return per_pair.sum() / normalizer, parts
