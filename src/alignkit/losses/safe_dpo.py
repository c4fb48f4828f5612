"""Safe-MM-DPO pieces (ALGORITHMS 1.3-1.5, "best reconstruction"): MM-DPO dynamic beta, the
lambda-weighted helpful/harmless mix, and the Safe RLHF dual (lambda) update.

The caller computes ``loss_h = dpo_loss(...helpful pairs..., beta=dynamic_beta(delta_h))`` and
``loss_s`` likewise on pairs ordered by ``safer_response_id`` with delta_s = C(y_l) - C(y_w), then
mixes them with :func:`safe_dpo_loss`. ``lagrange_update`` runs on the all-reduced cost estimate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def dynamic_beta(delta: Tensor, *, beta_base: float = 0.1, w: float = 0.5, k: float = 0.5) -> Tensor:
    """MM-DPO per-pair beta:  beta_base * (1 + w*(1 - exp(-k*|delta|)))  (ALGORITHMS 1.4).

    ``delta`` ``(B,)`` is a frozen reward model's margin r(y_w) - r(y_l); the result ``(B,)`` lies in
    ``[beta_base, (1+w)*beta_base]`` (clamped) and is detached, so it only re-weights pairs.
    """
    if not beta_base > 0 or w < 0 or k < 0:
        raise ValueError(f"dynamic_beta needs beta_base > 0, w >= 0, k >= 0; got {beta_base}, {w}, {k}")
    d = delta.detach()
    d = d if d.is_floating_point() else d.float()
    beta = beta_base * (1 + w * (1 - torch.exp(-k * d.abs())))
    return beta.clamp(beta_base, (1 + w) * beta_base)


def safe_dpo_loss(loss_h: Tensor, loss_s: Tensor, lam: float) -> Tensor:
    """``(loss_h + lam*loss_s) / (1 + lam)`` per pair, ``(B,)``; lam is a constant for the step."""
    if not lam >= 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    return (loss_h + lam * loss_s) / (1 + lam)


def lagrange_update(log_lam: float, j_c: float, *, threshold: float, lr: float, lam_max: float) -> float:
    """One dual step in log space (Safe RLHF code, ALGORITHMS 1.3):

        log_lam <- min(log_lam + lr * exp(log_lam) * (j_c - threshold), log(lam_max))

    lambda grows while the expected cost ``j_c`` exceeds ``threshold`` and shrinks (towards 0, never
    below it) otherwise. ``j_c`` must be the same on every rank (reduce, then broadcast the result).
    """
    if not lam_max > 0 or lr < 0:
        raise ValueError(f"lagrange_update needs lam_max > 0 and lr >= 0; got lam_max={lam_max}, lr={lr}")
    stepped = log_lam + lr * math.exp(log_lam) * (j_c - threshold)
    return min(stepped, math.log(lam_max))
