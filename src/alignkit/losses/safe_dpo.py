"""Safe-MM-DPO pieces (ALGORITHMS 1.3-1.5, "best reconstruction"): MM-DPO dynamic beta, the
lambda-weighted helpful/harmless mix, and the Safe RLHF dual (lambda) update.

The caller computes ``loss_h = dpo_loss(...helpful pairs..., beta=dynamic_beta(delta_h))`` and
``loss_s`` likewise on pairs ordered by ``safer_response_id`` with delta_s = C(y_l) - C(y_w), then
mixes them with :func:`safe_dpo_loss`. ``lagrange_update`` (gradient ascent on ln lambda) or
``pid_lagrange_update`` (PID Lagrangian) runs on the all-reduced cost estimate.

:func:`safe_rows_loss` does all of it per PKU-SafeRLHF row, for the variants of ``SAFE_DPO_VARIANTS``:
``mm_dpo`` (Safe-MM-DPO), ``safedpo`` (label swap + safety margin) and ``modpo`` (MODPO margin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from alignkit.registry import Registry


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


class PIDState(NamedTuple):
    """What the PID rule carries between updates (all floats, so it round-trips through JSON).

    ``integral``: I, already scaled by K_I (rlpyt / omnisafe keep it so; it starts at lambda_init, as
    their ``pid_i = penalty_init``); ``error_ema`` / ``cost_ema``: the EMAs of J_C - d (P's input) and of
    J_C (D's input), None before the first update; ``history``: the last ``d_delay`` cost EMAs, oldest first.
    """

    integral: float
    error_ema: float | None = None
    cost_ema: float | None = None
    history: tuple[float, ...] = ()


def pid_lagrange_update(state: PIDState, j_c: float, *, threshold: float, kp: float, ki: float, kd: float,
                        lam_max: float, d_delay: int = 1, ema_alpha: float = 0.0) -> tuple[float, PIDState]:
    """One PID-Lagrangian step (Stooke, Achiam & Abbeel 2020, arXiv 2007.03964, Algorithm 2, with the
    EMA and derivative delay of its code, rlpyt ``CppoPID.optimize_agent`` = omnisafe
    ``PIDLagrangian.pid_update``); returns (lambda, the new state):

        e = J_C - d
        I <- clamp(I + K_I e, 0, lam_max)                 # integral; anti-windup at 0 (Alg. 2: I <- (I + e)_+)
        P <- alpha P + (1 - alpha) e                      # EMA of the error
        C <- alpha C + (1 - alpha) J_C                    # EMA of the cost
        D  = max(0, C - C[d_delay updates ago])           # only a RISING cost pushes lambda up
        lambda = clamp(K_P P + I + K_D D, 0, lam_max)

    Two choices differ from the reference code: the first update seeds both EMAs with its own values and
    has no derivative (rlpyt starts them at 0, so its first D is (J_C)_+, a kick that a signed cost model
    would give for nothing), and I is also clamped at lam_max (lambda never exceeds it, so integral
    beyond it would only delay the fall once the constraint holds). K_I e with K_P = K_D = 0 is the
    gradient-ascent multiplier in lambda itself (Stooke et al. section 4).
    """
    if not lam_max > 0 or min(kp, ki, kd) < 0 or d_delay < 1 or not 0 <= ema_alpha < 1:
        raise ValueError(f"pid_lagrange_update needs lam_max > 0, gains >= 0, d_delay >= 1, 0 <= ema_alpha < 1; "
                         f"got {lam_max}, {(kp, ki, kd)}, {d_delay}, {ema_alpha}")
    e, a = j_c - threshold, ema_alpha
    integral = min(max(0.0, state.integral + ki * e), lam_max)
    p = e if state.error_ema is None else a * state.error_ema + (1 - a) * e
    c = j_c if state.cost_ema is None else a * state.cost_ema + (1 - a) * j_c
    d = max(0.0, c - state.history[0]) if state.history else 0.0
    lam = min(max(0.0, kp * p + integral + kd * d), lam_max)
    return lam, PIDState(integral, p, c, (state.history + (c,))[-d_delay:])


# ---------------------------------------------------------------------------------------------------
# Per-row losses of the safety-constrained DPO variants (``SAFE_DPO_VARIANTS``).
#
# A PKU-SafeRLHF row has two responses y_0, y_1 and two orderings of them: the helpful pair
# (chosen = y_better) and the safety pair (chosen = y_safer). The policy and the reference see each
# response ONCE; the pairs are index views of those two log-prob sums, so a step costs a DPO step.
# ---------------------------------------------------------------------------------------------------


class SafeRows(NamedTuple):
    """Everything the variants read, one entry per row; every field ``(B,)``.

    ``logp``/``ref``: summed response log-probs of y_0 and y_1 under the policy / the reference.
    ``better``/``safer``: 0 or 1 (``better_response_id``, ``safer_response_id``). ``reward``: frozen
    helpful-RM scores, ``cost``: frozen cost-model scores (C > 0 = unsafe), ``unsafe``: the labels
    (``not is_response_k_safe``); ``lengths``: response token counts. Frozen fields may be None when
    the variant does not read them.
    """

    logp_0: Tensor
    logp_1: Tensor
    ref_0: Tensor
    ref_1: Tensor
    better: Tensor
    safer: Tensor
    len_0: Tensor
    len_1: Tensor
    reward_0: Tensor | None = None
    reward_1: Tensor | None = None
    cost_0: Tensor | None = None
    cost_1: Tensor | None = None
    unsafe_0: Tensor | None = None
    unsafe_1: Tensor | None = None


@dataclass(frozen=True)
class SafeParams:
    """Hyperparameters: beta_0 (``dpo.beta``), the dynamic-beta shape ``w``/``k``, lambda (a constant
    for the step), the KL coefficient and estimator, SafeDPO's margin, MODPO's weight w_0 and the weight
    of the per-token NLL of the safer response where it is labelled safe (RPO on the safety pair)."""

    beta: float = 0.1
    w: float = 0.5
    k: float = 0.5
    lam: float = 1.0
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"
    safety_margin: float = 0.0
    modpo_weight: float = 0.5
    safe_nll_coeff: float = 0.0


def ordered(x_0: Tensor, x_1: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_first, x_other)`` per row: the pair whose chosen side is response ``first`` (0/1)."""
    pick_1 = first.bool()
    return torch.where(pick_1, x_1, x_0), torch.where(pick_1, x_0, x_1)


def _need(value: Tensor | None, name: str, variant: str) -> Tensor:
    if value is None:
        raise ValueError(f"safe_dpo variant {variant!r} needs {name}")
    return value


def implicit_margin(r: SafeRows, first: Tensor) -> Tensor:
    """h = [logp(y_w) - ref(y_w)] - [logp(y_l) - ref(y_l)] for the pair with chosen = ``first``."""
    ratio_w, ratio_l = ordered(r.logp_0 - r.ref_0, r.logp_1 - r.ref_1, first)
    return ratio_w - ratio_l


def kl_term(r: SafeRows, estimator: str) -> tuple[Tensor, Tensor]:
    """``(penalty (B,), k1 (B,))`` on the row's two (offline) responses.

    k1 = per-token mean of log pi - log pi_ref over both responses (what is logged as KL). The
    penalty is the chosen estimator applied to that per-token mean log-ratio: k1 itself, or k3 =
    e^{-l} - 1 + l (>= 0, quadratic near 0). The responses are dataset responses, not samples of the
    policy, so this is a regulariser of the log-ratio, not an unbiased KL(pi || pi_ref).
    """
    n = (r.len_0 + r.len_1).clamp_min(1)
    k1 = ((r.logp_0 - r.ref_0) + (r.logp_1 - r.ref_1)) / n
    if estimator == "k1":
        return k1, k1
    if estimator == "k3":
        return torch.expm1(-k1) + k1, k1
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


SafeVariantFn = Callable[[SafeRows, SafeParams], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class SafeVariant:
    """A loss of the registry plus what it reads: the frozen helpful RM, the cost model, the per-response
    safety labels, and whether lambda enters the loss (else the multiplier is only monitored)."""

    fn: SafeVariantFn
    needs_reward: bool
    needs_cost: bool
    needs_labels: bool
    uses_lambda: bool


SAFE_DPO_VARIANTS: Registry[SafeVariant] = Registry("safe_dpo.variant")


def _mm_dpo(r: SafeRows, p: SafeParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Safe-MM-DPO, ALGORITHMS 1.5 "best reconstruction":
    loss_H = -log sigma(beta(delta_H) h_H) on the helpful pair, delta_H = R(y_w) - R(y_l);
    loss_S = -log sigma(beta(delta_S) h_S) on the safety pair, delta_S = C(y_l) - C(y_w);
    L = (loss_H + lam loss_S) / (1 + lam)."""
    reward_w, reward_l = ordered(_need(r.reward_0, "reward", "mm_dpo"), _need(r.reward_1, "reward", "mm_dpo"), r.better)
    cost_w, cost_l = ordered(_need(r.cost_0, "cost", "mm_dpo"), _need(r.cost_1, "cost", "mm_dpo"), r.safer)
    beta_h = dynamic_beta(reward_w - reward_l, beta_base=p.beta, w=p.w, k=p.k)
    beta_s = dynamic_beta(cost_l - cost_w, beta_base=p.beta, w=p.w, k=p.k)
    h_h, h_s = implicit_margin(r, r.better), implicit_margin(r, r.safer)
    loss_h, loss_s = -F.logsigmoid(beta_h * h_h), -F.logsigmoid(beta_s * h_s)
    metrics = {"loss_H": loss_h.detach(), "loss_S": loss_s.detach(), "beta_H": beta_h, "beta_S": beta_s,
               "margin_H": (beta_h * h_h).detach(), "margin_S": (beta_s * h_s).detach()}
    return safe_dpo_loss(loss_h, loss_s, p.lam), metrics


def _safedpo(r: SafeRows, p: SafeParams) -> tuple[Tensor, dict[str, Tensor]]:
    """SafeDPO (Kim et al. 2025, ALGORITHMS 1.6): the helpful pair, swapped when its chosen response is
    unsafe and its rejected one safe; -log sigma(beta h' + (u_l' - u_w') Delta), u = 1 if unsafe."""
    u_0 = _need(r.unsafe_0, "unsafe labels", "safedpo").to(r.logp_0.dtype)
    u_1 = _need(r.unsafe_1, "unsafe labels", "safedpo").to(r.logp_0.dtype)
    u_w, u_l = ordered(u_0, u_1, r.better)
    swap = (u_w > u_l).long()  # chosen unsafe, rejected safe
    first = torch.where(swap.bool(), 1 - r.better, r.better)
    u_w, u_l = ordered(u_0, u_1, first)
    h = implicit_margin(r, first)
    losses = -F.logsigmoid(p.beta * h + (u_l - u_w) * p.safety_margin)
    return losses, {"loss_H": losses.detach(), "swapped": swap.to(h.dtype), "margin_H": (p.beta * h).detach()}


def _modpo(r: SafeRows, p: SafeParams) -> tuple[Tensor, dict[str, Tensor]]:
    """MODPO-style margin (Zhou et al. 2023, ALGORITHMS 1.6) on the helpful pair with the safety reward
    -C as the margin objective: -log sigma((beta h - w_1 [(-C(y_w)) - (-C(y_l))]) / w_0), w_1 = 1 - w_0."""
    cost_w, cost_l = ordered(_need(r.cost_0, "cost", "modpo"), _need(r.cost_1, "cost", "modpo"), r.better)
    w0 = p.modpo_weight
    h = implicit_margin(r, r.better)
    z = (p.beta * h - (1 - w0) * (cost_l - cost_w)) / w0
    losses = -F.logsigmoid(z)
    return losses, {"loss_H": losses.detach(), "margin_H": z.detach()}


SAFE_DPO_VARIANTS.register("mm_dpo")(SafeVariant(_mm_dpo, needs_reward=True, needs_cost=True, needs_labels=False,
                                                 uses_lambda=True))
SAFE_DPO_VARIANTS.register("safedpo")(SafeVariant(_safedpo, needs_reward=False, needs_cost=False, needs_labels=True,
                                                  uses_lambda=False))
SAFE_DPO_VARIANTS.register("modpo")(SafeVariant(_modpo, needs_reward=False, needs_cost=True, needs_labels=False,
                                                uses_lambda=False))


def safe_rows_loss(rows: SafeRows, params: SafeParams, variant: str = "mm_dpo") -> tuple[Tensor, dict[str, Tensor]]:
    """Per-row loss ``(B,)`` of ``variant`` plus ``kl_coeff`` x the KL penalty, and detached ``(B,)``
    metrics: ``loss_H`` (and ``loss_S`` for mm_dpo), ``KL`` (k1 per-token mean), variant extras."""
    shape = rows.logp_0.shape
    for name, t in zip(SafeRows._fields, rows):
        if t is not None and t.shape != shape:
            raise ValueError(f"safe_rows_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not params.beta > 0 or not 0 < params.modpo_weight <= 1 or params.kl_coeff < 0:
        raise ValueError(f"safe_rows_loss: need beta > 0, 0 < modpo_weight <= 1, kl_coeff >= 0; got {params}")
    losses, metrics = SAFE_DPO_VARIANTS.get(variant).fn(rows, params)
    penalty, k1 = kl_term(rows, params.kl_estimator)
    if params.kl_coeff:
        losses = losses + params.kl_coeff * penalty
    metrics["KL"] = k1.detach()
    if params.safe_nll_coeff:
        losses = losses + params.safe_nll_coeff * safe_response_nll(rows)
    return losses, metrics


def safe_response_nll(r: SafeRows) -> Tensor:
    """``(B,)`` per-token NLL -log pi(y_safer) / |y_safer| of each row's safer response, 0 where that response
    is itself labelled unsafe (both responses unsafe): the RPO term (Pang et al. 2024) on the safety pair,
    which keeps the refusals the policy is pushed towards well-formed."""
    logp_w, _ = ordered(r.logp_0, r.logp_1, r.safer)
    len_w, _ = ordered(r.len_0, r.len_1, r.safer)
    u_w, _ = ordered(_need(r.unsafe_0, "unsafe labels", "safe_nll_coeff"),
                     _need(r.unsafe_1, "unsafe labels", "safe_nll_coeff"), r.safer)
    return torch.where(u_w.bool(), torch.zeros_like(logp_w), -logp_w / len_w.clamp_min(1))
