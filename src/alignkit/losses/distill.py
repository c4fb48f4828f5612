"""On-policy distillation's per-token divergence (GKD, Agarwal et al. 2024, eq. 1), as a pure function over the
full next-token distributions of the student and the teacher at the student's own sampled positions.

``generalized_jsd(student_logps, teacher_logps, beta)`` with ``(N, V)`` log-probabilities, TRL's convention
(``GKDTrainer.generalized_jsd_loss``, trl 1.16): ``beta = 0`` is the forward KL(teacher || student), ``beta = 1``
the reverse KL(student || teacher) (on-policy distillation's "mode seeking" loss), and in between
``beta KL(teacher || M) + (1 - beta) KL(student || M)`` with the mixture M = beta teacher + (1 - beta) student.
Returns the ``(N,)`` per-token divergence (summed over the vocabulary); the gradient reaches the student only
through ``student_logps`` (pass the teacher's detached).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def kl(p_logps: Tensor, q_logps: Tensor) -> Tensor:
    """``(N,)`` KL(p || q) = sum_v p (log p - log q) of ``(N, V)`` log-probabilities."""
    return (p_logps.exp() * (p_logps - q_logps)).sum(-1)


def generalized_jsd(student_logps: Tensor, teacher_logps: Tensor, *, beta: float) -> Tensor:
    """``(N,)`` GKD's generalised Jensen-Shannon divergence at each position (module docstring)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"the generalised JSD's beta must lie in [0, 1], got {beta}")
    if beta == 0.0:
        return kl(teacher_logps, student_logps)
    if beta == 1.0:
        return kl(student_logps, teacher_logps)
    mixture = torch.logsumexp(torch.stack([student_logps + math.log1p(-beta), teacher_logps + math.log(beta)]), dim=0)
    return beta * kl(teacher_logps, mixture) + (1.0 - beta) * kl(student_logps, mixture)
