"""Bradley-Terry reward-model loss (ALGORITHMS 1.2 and 4)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    *,
    margin: Tensor | None = None,
    center_coeff: float = 0.0,
    reg_coeff: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair  -log sigma(r_c - r_r - m) + center_coeff*(r_c + r_r)^2 + reg_coeff*(r_c^2 + r_r^2)/2.

    The mean over pairs of the two extra terms equals TRL's ``center_rewards_coefficient *
    mean((r_c + r_r)^2)`` and Safe RLHF's ``reg * mean(R^2)`` over all scored responses.

    Args:
        chosen_scores: ``(B,)`` scalar-head scores of the preferred responses.
        rejected_scores: ``(B,)`` scores of the other responses.
        margin: optional ``(B,)`` required score gap (Llama-2 style), no gradient expected.
        center_coeff: weight of the centring term (keeps scores near 0).
        reg_coeff: weight of the L2 term on the scores.

    Returns:
        ``(losses (B,), metrics)`` with detached ``(B,)`` metrics ``accuracy`` (1.0 when r_c > r_r),
        ``margin`` (r_c - r_r), ``chosen``, ``rejected``.
    """
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(f"chosen {tuple(chosen_scores.shape)} and rejected {tuple(rejected_scores.shape)} scores differ in shape")
    diff = chosen_scores - rejected_scores
    losses = -F.logsigmoid(diff if margin is None else diff - margin)
    if center_coeff:
        losses = losses + center_coeff * (chosen_scores + rejected_scores).square()
    if reg_coeff:
        losses = losses + reg_coeff * 0.5 * (chosen_scores.square() + rejected_scores.square())
    diff = diff.detach()
    metrics = {
        "accuracy": (diff > 0).to(diff.dtype),
        "margin": diff,
        "chosen": chosen_scores.detach(),
        "rejected": rejected_scores.detach(),
    }
    return losses, metrics
