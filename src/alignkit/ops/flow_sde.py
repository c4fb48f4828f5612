"""One step of Flow-GRPO's SDE sampler with the log-probability of the transition (ALGORITHMS 2.4; flow_grpo's
``sd3_sde_with_logprob.py``, Liu et al., arXiv 2505.05470).

The flow ODE dx = v dt turned into an SDE with the same marginals; from noise level ``sigma`` to ``sigma_next``
(dt = sigma_next - sigma < 0):

* std_t = a sqrt(sigma / (1 - sigma)), noise level ``a`` (flow_grpo: 0.7); where sigma = 1 (the first step of
  the schedule) the 1 - sigma under the root uses ``sigma_cap`` (flow_grpo: the schedule's second sigma);
* mean = x (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt;
* x_next = mean + std_t sqrt(-dt) eps, eps ~ N(0, I);
* log p(x_next | x) = the Gaussian log-density N(x_next; mean, (std_t sqrt(-dt))^2 I), averaged over the elements
  of each sample (not summed: flow_grpo's convention, which keeps the ratio's scale independent of the image size).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class SDEStep(NamedTuple):
    """``sample`` ``(B, ...)`` the next latents; ``logp`` ``(B,)``; ``mean`` ``(B, ...)``; ``std`` ``(B,)`` the
    transition's standard deviation std_t sqrt(-dt); ``std_t`` ``(B,)`` the SDE's noise scale at sigma (Flow-GRPO's
    KL term divides by its square: ``losses.flow.flow_grpo_loss``)."""

    sample: Tensor
    logp: Tensor
    mean: Tensor
    std: Tensor
    std_t: Tensor


def sde_step(velocity: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float = 0.7,
             sigma_cap: float | Tensor | None = None, noise: Tensor | None = None, next_sample: Tensor | None = None) -> SDEStep:
    """The step from ``sample`` (``(B, ...)``, at ``sigma`` ``(B,)``) to ``sigma_next`` ``(B,)`` under the predicted
    ``velocity`` (module docstring); ``sigma_cap``: a float, or ``(B,)`` one per sample. The next sample is
    ``next_sample`` when given (recomputing the log-prob of a stored transition under the current policy), else
    drawn with ``noise`` (``(B, ...)`` standard normal; a fresh ``randn`` when None). Computed in fp32."""
    v, x = velocity.float(), sample.float()
    shape = (-1,) + (1,) * (x.dim() - 1)
    s, s_next = sigma.float().reshape(shape), sigma_next.float().reshape(shape)
    dt = s_next - s
    if (dt >= 0).any():
        raise ValueError("sde_step integrates from noise to data: sigma_next must be below sigma")
    if sigma_cap is None:
        cap = s
    elif isinstance(sigma_cap, Tensor):  # a stored transition's, on the device: no host read
        cap = sigma_cap.to(s).reshape(shape)
    else:
        cap = torch.full_like(s, sigma_cap)
    std_t = noise_level * torch.sqrt(s / (1 - torch.where(s >= 1, cap, s)))
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * torch.sqrt(-dt)
    if next_sample is None:
        eps = torch.randn_like(x) if noise is None else noise.float()
        next_sample = mean + std * eps
    target = next_sample.detach().float()
    logp = -((target - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return SDEStep(next_sample, logp.flatten(1).mean(dim=1), mean, std.flatten(), std_t.flatten())


def ode_step(velocity: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """The deterministic Euler step of the flow ODE, x + v (sigma_next - sigma): diffusers'
    ``FlowMatchEulerDiscreteScheduler.step`` (evaluation and ``alignkit generate``). Computed in fp32."""
    shape = (-1,) + (1,) * (sample.dim() - 1)
    dt = (sigma_next.float() - sigma.float()).reshape(shape)
    return sample.float() + velocity.float() * dt
