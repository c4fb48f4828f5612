"""Safe RLHF cost-model loss (ALGORITHMS 1.2). Convention: C > 0 means unsafe."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cost_model_loss(
    unsafer_scores: Tensor,
    safer_scores: Tensor,
    unsafer_is_unsafe: Tensor,
    safer_is_unsafe: Tensor,
    *,
    reg_coeff: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair  -log sigma(C_h - C_s) - log sigma(s_h*C_h) - log sigma(s_s*C_s)  (+ reg).

    ``C_h``/``C_s`` are the costs of the more harmful (unsafer) and the safer response; ``s = +1`` for a
    response labelled unsafe and ``-1`` for a safe one (Safe RLHF ``cost_sign``). The ranking term
    orders the pair; the two sign terms pin 0 as the safe/unsafe boundary.
    The regulariser is ``reg_coeff * (C_h^2 + C_s^2) / 2`` (its pair mean = ``reg * mean(C^2)``).

    Args:
        unsafer_scores: ``(B,)`` cost of the less safe response.
        safer_scores: ``(B,)`` cost of the safer response.
        unsafer_is_unsafe: ``(B,)`` bool, label of the less safe response.
        safer_is_unsafe: ``(B,)`` bool, label of the safer response.

    Returns:
        ``(losses (B,), metrics)`` with detached ``(B,)`` metrics: ``accuracy`` (C_h > C_s),
        ``sign_accuracy`` (fraction of the pair's two responses with ``(C > 0) == is_unsafe``;
        C == 0 counts as safe), ``unsafer``, ``safer``.
    """
    shapes = {tuple(t.shape) for t in (unsafer_scores, safer_scores, unsafer_is_unsafe, safer_is_unsafe)}
    if len(shapes) != 1:
        raise ValueError(f"cost_model_loss inputs must share one (B,) shape, got {sorted(shapes)}")
    sign_h = torch.where(unsafer_is_unsafe.bool(), 1.0, -1.0).to(unsafer_scores.dtype)
    sign_s = torch.where(safer_is_unsafe.bool(), 1.0, -1.0).to(safer_scores.dtype)
    losses = (
        -F.logsigmoid(unsafer_scores - safer_scores)
        - F.logsigmoid(sign_h * unsafer_scores)
        - F.logsigmoid(sign_s * safer_scores)
    )
    if reg_coeff:
        losses = losses + reg_coeff * 0.5 * (unsafer_scores.square() + safer_scores.square())
    c_h, c_s = unsafer_scores.detach(), safer_scores.detach()
    sign_ok = ((c_h > 0) == unsafer_is_unsafe.bool()).to(c_h.dtype) + ((c_s > 0) == safer_is_unsafe.bool()).to(c_h.dtype)
    metrics = {
        "accuracy": (c_h > c_s).to(c_h.dtype),
        "sign_accuracy": sign_ok / 2,
        "unsafer": c_h,
        "safer": c_s,
    }
    return losses, metrics
