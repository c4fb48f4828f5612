"""ORPO: odds-ratio preference optimisation on top of SFT, no reference model (Hong et al., arXiv 2403.07691).

Notation: ``logp(y)`` is the SUM of log-probs over the response tokens only and ``|y|`` their count;
``a(y) = logp(y) / |y|`` the length-normalised log-prob (the paper's P(y|x) = exp(a(y))), and
``odds(y) = P / (1 - P)``, so  log odds(y) = a(y) - log(1 - exp(a(y)))  (Eq. 4).

  L = L_SFT + lambda * L_OR                                              (Eq. 6)
  L_SFT = -a(y_w)              the chosen response's per-token NLL      (Eq. 2)
  L_OR  = -log sigma(log odds(y_w) - log odds(y_l))                     (Eq. 7)

``lambda`` is TRL's ``beta`` (ORPOConfig, default 0.1). The odds-ratio term equals TRL 1.16's
``ORPOTrainer.odds_ratio_loss`` on the same length-normalised log-probs (benchmarks/crosscheck_kto_orpo.py).
TRL's NLL differs on purpose: it is the token mean over the micro-batch's chosen sequences *prompt
included*; here it is the paper's per-response mean over response tokens, so a pair is one loss unit
whatever its length or the batch layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

#: a(y) is clamped below 0 by this much: at a(y) == 0 exactly (every token has probability 1 in float32)
#: log(1 - exp(a)) is -inf and its gradient NaN
_MAX_AVG_LOGP = -1e-7


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (Maechler 2012; TRL's ``log1mexp``)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair ORPO loss ``-a(y_w) + beta * -log sigma(log odds(y_w) - log odds(y_l))`` (module docstring).

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(B,)`` summed response log-probs.
        chosen_lengths, rejected_lengths: ``(B,)`` response token counts (>= 1).
        beta: the odds-ratio weight lambda (> 0).

    Returns:
        ``(losses (B,), metrics)``; metrics are detached ``(B,)`` tensors: ``nll`` (-a(y_w)),
        ``log_odds_ratio`` (log sigma of the log-odds difference), ``log_odds_chosen`` (that difference),
        ``rewards/chosen`` / ``rewards/rejected`` (beta * a(y), TRL's), ``rewards/margin`` and
        ``logps/chosen`` / ``logps/rejected`` (a(y), the length-normalised log-probs).
    """
    shape = policy_chosen_logps.shape
    for name, t in (("policy_rejected_logps", policy_rejected_logps), ("chosen_lengths", chosen_lengths),
                    ("rejected_lengths", rejected_lengths)):
        if t.shape != shape:
            raise ValueError(f"orpo_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not beta > 0:
        raise ValueError(f"orpo_loss: beta must be > 0, got {beta}")
    # float32 at least: log(1 - exp(a)) near a = 0 loses every digit in bf16
    chosen = (policy_chosen_logps.float() / chosen_lengths.clamp_min(1)).clamp(max=_MAX_AVG_LOGP)
    rejected = (policy_rejected_logps.float() / rejected_lengths.clamp_min(1)).clamp(max=_MAX_AVG_LOGP)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = -chosen
    losses = nll - beta * ratio
    c, r = beta * chosen.detach(), beta * rejected.detach()
    metrics = {
        "nll": nll.detach(),
        "log_odds_ratio": ratio.detach(),
        "log_odds_chosen": log_odds.detach(),
        "rewards/chosen": c,
        "rewards/rejected": r,
        "rewards/margin": c - r,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }
    return losses, metrics
