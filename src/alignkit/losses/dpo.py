"""The DPO family from sequence log-probs (ALGORITHMS 4). Pick a variant by name: ``DPO_LOSSES``.

Notation: ``logp(y)`` is the SUM of log-probs over the response tokens only (prompt and image
tokens masked);  h = [logp(y_w) - logp_ref(y_w)] - [logp(y_l) - logp_ref(y_l)].

  sigmoid  DPO   -log sigma(beta*h); with label_smoothing eps it is cDPO:
                 -(1-eps) log sigma(beta*h) - eps log sigma(-beta*h)
  ipo      IPO   (h - 1/(2*beta))^2  (beta plays tau). When chosen/rejected lengths are given every
                 log-ratio is divided by its response's token count first, as TRL does (IPO authors'
                 recommendation); without lengths it is the paper's sum form.
  simpo    SimPO -log sigma(beta*logp(y_w)/|y_w| - beta*logp(y_l)/|y_l| - gamma); reference-free
                 (ref logps, if passed, are ignored); label smoothing works as for sigmoid.

``beta`` may be a float or a per-pair ``(B,)`` tensor (MM-DPO dynamic beta, ``safe_dpo.dynamic_beta``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch.nn.functional as F
from torch import Tensor

from alignkit.registry import Registry


class _Pairs(NamedTuple):
    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_lengths: Tensor | None
    rejected_lengths: Tensor | None


#: ``fn(pairs, beta, label_smoothing, simpo_gamma) -> (losses, chosen_rewards, rejected_rewards)``
DpoLossFn = Callable[[_Pairs, "float | Tensor", float, float], tuple[Tensor, Tensor, Tensor]]
DPO_LOSSES: Registry[DpoLossFn] = Registry("dpo loss_type")


def _logistic(z: Tensor, label_smoothing: float) -> Tensor:
    """-(1-eps) log sigma(z) - eps log sigma(-z); logsigmoid is stable for large |z|."""
    losses = -F.logsigmoid(z)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-z)
    return losses


def _need_ref(p: _Pairs, name: str) -> tuple[Tensor, Tensor]:
    if p.ref_chosen is None or p.ref_rejected is None:
        raise ValueError(f"dpo loss_type {name!r} needs ref_chosen_logps and ref_rejected_logps (got None)")
    return p.ref_chosen, p.ref_rejected


def _need_lengths(p: _Pairs, name: str) -> tuple[Tensor, Tensor]:
    if p.chosen_lengths is None or p.rejected_lengths is None:
        raise ValueError(f"dpo loss_type {name!r} needs chosen_lengths and rejected_lengths (response token counts)")
    return p.chosen_lengths, p.rejected_lengths


@DPO_LOSSES.register("sigmoid")
def _sigmoid(p: _Pairs, beta: float | Tensor, label_smoothing: float, simpo_gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    ref_c, ref_r = _need_ref(p, "sigmoid")
    chosen = beta * (p.policy_chosen - ref_c)
    rejected = beta * (p.policy_rejected - ref_r)
    return _logistic(chosen - rejected, label_smoothing), chosen, rejected


@DPO_LOSSES.register("ipo")
def _ipo(p: _Pairs, beta: float | Tensor, label_smoothing: float, simpo_gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    ref_c, ref_r = _need_ref(p, "ipo")
    ratio_c, ratio_r = p.policy_chosen - ref_c, p.policy_rejected - ref_r
    if (p.chosen_lengths is None) != (p.rejected_lengths is None):
        raise ValueError("dpo loss_type 'ipo': pass both chosen_lengths and rejected_lengths, or neither")
    if p.chosen_lengths is not None:
        ratio_c, ratio_r = ratio_c / p.chosen_lengths, ratio_r / p.rejected_lengths
    losses = (ratio_c - ratio_r - 1 / (2 * beta)).square()
    return losses, beta * ratio_c, beta * ratio_r


@DPO_LOSSES.register("simpo")
def _simpo(p: _Pairs, beta: float | Tensor, label_smoothing: float, simpo_gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    len_c, len_r = _need_lengths(p, "simpo")
    chosen = beta * p.policy_chosen / len_c
    rejected = beta * p.policy_rejected / len_r
    return _logistic(chosen - rejected - simpo_gamma, label_smoothing), chosen, rejected


def _check(pairs: _Pairs, beta: float | Tensor, label_smoothing: float, loss_type: str) -> None:
    shape = pairs.policy_chosen.shape
    for name, t in zip(_Pairs._fields, pairs):
        if t is not None and t.shape != shape:
            raise ValueError(f"dpo_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if isinstance(beta, Tensor):
        if beta.dim() > 0 and beta.shape != shape:
            raise ValueError(f"dpo_loss: per-pair beta has shape {tuple(beta.shape)}, expected {tuple(shape)}")
    elif not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if label_smoothing and loss_type == "ipo":
        raise ValueError("dpo_loss: label_smoothing applies to the logistic losses ('sigmoid', 'simpo'), not 'ipo'")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    loss_type: str = "sigmoid",
    beta: float | Tensor = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference loss of the variant ``loss_type`` (see the module docstring).

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(B,)`` summed response log-probs.
        ref_chosen_logps, ref_rejected_logps: ``(B,)`` from the frozen reference (no grad), or None
            for reference-free variants.
        beta: float > 0 or ``(B,)`` tensor (not detached here: detach it if it must not train).
        chosen_lengths, rejected_lengths: ``(B,)`` response token counts (simpo; optional for ipo).

    Returns:
        ``(losses (B,), metrics)``; metrics are detached ``(B,)`` tensors ``rewards/chosen``,
        ``rewards/rejected`` (the implicit rewards the loss compares: beta*(logp - ref_logp), per
        token for ipo with lengths, beta*logp/|y| for simpo), ``rewards/accuracy`` (1.0 when
        chosen > rejected) and ``rewards/margin`` (chosen - rejected).
    """
    fn = DPO_LOSSES.get(loss_type)
    pairs = _Pairs(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                   chosen_lengths, rejected_lengths)
    _check(pairs, beta, label_smoothing, loss_type)
    losses, chosen, rejected = fn(pairs, beta, label_smoothing, simpo_gamma)
    chosen, rejected = chosen.detach(), rejected.detach()
    metrics = {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracy": (chosen > rejected).to(chosen.dtype),
        "rewards/margin": chosen - rejected,
    }
    return losses, metrics
