"""KTO: Kahneman-Tversky optimisation on unpaired desirable / undesirable completions
(Ethayarajh et al., arXiv 2402.01306, Eq. 7-8).

Notation: ``logp(y)`` is the SUM of log-probs over the completion tokens only; the implicit reward
r(x, y) = logp(y|x) - logp_ref(y|x); the reference point z0 = max(0, KL estimate), where the KL
estimate is the mean of r(x, y') over MISMATCHED pairs (a prompt with another example's completion),
detached (no gradient flows through z0: it is a baseline, as in the paper and TRL).

  desirable y:    L = desirable_weight   * (1 - sigma(beta * (r - z0)))
  undesirable y:  L = undesirable_weight * (1 - sigma(beta * (z0 - r)))

These equal TRL 1.16's ``KTOTrainer`` (``loss_type="kto"``) on the same inputs
(benchmarks/crosscheck_kto_orpo.py). Which batch z0 is estimated over is the caller's: alignkit's
KTO uses every mismatched pair of the optimizer step (all micro-batches, all ranks), so z0 does not
depend on the accumulation or the number of ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kto_reference_point(kl_sum: Tensor, kl_count: Tensor) -> Tensor:
    """z0 = max(0, kl_sum / kl_count), detached: ``kl_sum`` is the sum over mismatched pairs of
    logp(y'|x) - logp_ref(y'|x) and ``kl_count`` their number (both already summed over ranks)."""
    return (kl_sum.detach() / kl_count.detach().clamp_min(1)).clamp_min(0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    z0: Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-example weighted KTO loss (module docstring).

    Args:
        policy_logps, ref_logps: ``(B,)`` summed completion log-probs (the reference's without grad).
        desirable: ``(B,)`` bool, True for a desirable completion.
        z0: the reference point (0-d tensor or float, >= 0, no grad: :func:`kto_reference_point`).
        beta: > 0; desirable_weight, undesirable_weight: >= 0 (paper: keep
            desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3]).

    Returns:
        ``(losses (B,), metrics)``: the weighted per-example losses; metrics ``rewards`` ``(B,)`` =
        beta * r (detached; split into chosen / rejected by ``desirable`` for logging).
    """
    if policy_logps.shape != ref_logps.shape or policy_logps.shape != desirable.shape:
        raise ValueError(f"kto_loss: policy_logps {tuple(policy_logps.shape)}, ref_logps {tuple(ref_logps.shape)} "
                         f"and desirable {tuple(desirable.shape)} must have the same shape")
    if not beta > 0:
        raise ValueError(f"kto_loss: beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"kto_loss: the weights must be >= 0, got {desirable_weight}, {undesirable_weight}")
    if isinstance(z0, Tensor):
        z0 = z0.detach()
    logratio = policy_logps - ref_logps
    desirable = desirable.bool()
    # the sign flips for undesirable completions: sigma(beta * s * (r - z0)), s = +1 / -1
    sign = desirable.to(logratio.dtype) * 2 - 1
    weight = torch.where(desirable, desirable_weight, undesirable_weight).to(logratio.dtype)
    losses = weight * (1 - torch.sigmoid(beta * sign * (logratio - z0)))
    return losses, {"rewards": beta * logratio.detach()}
