"""Advantage estimators (ALGORITHMS 3 and 4), as pure functions picked by name.

Outcome estimators (``grpo``, ``rloo``, ``dr_grpo``) take the rewards of the WHOLE iteration, gathered
from every rank in global order, ``(P * G,)`` with the G completions of a prompt contiguous, and
return one advantage per completion. Groups therefore stay whole however the completions were spread
over ranks, and every rank computes the same numbers; each then takes its own slice. A NaN reward
(unscorable) is left out of its group's statistics and gets advantage 0: masked, never zeroed into
the mean.

``gae`` works per token on one sequence batch (values from a critic); :func:`whiten` uses a mean and
variance the caller reduced over every rank (OpenRLHF's global whitening).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from alignkit.registry import Registry

OutcomeEstimator = Callable[..., Tensor]
ADVANTAGES: Registry[OutcomeEstimator] = Registry("advantage estimator")

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's epsilon: a group with identical rewards gets advantage 0, not a division by 0


def _groups(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``(P, G)`` rewards with NaN replaced by 0, and the ``(P, G)`` mask of scored ones."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    ok = ~torch.isnan(r)
    return torch.where(ok, r, torch.zeros_like(r)), ok


def _group_mean(r: Tensor, ok: Tensor) -> Tensor:
    return r.sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp_min(1)


def _masked_std(r: Tensor, ok: Tensor, mean: Tensor, dim: int | None) -> Tensor:
    """Sample standard deviation (Bessel-corrected, as torch.std) over the scored entries."""
    dev = torch.where(ok, r - mean, torch.zeros_like(r)).square()
    if dim is None:
        n = ok.sum()
        return (dev.sum() / (n - 1).clamp_min(1)).sqrt()
    n = ok.sum(dim, keepdim=True)
    return (dev.sum(dim, keepdim=True) / (n - 1).clamp_min(1)).sqrt()


def group_nanstd(rewards: Tensor, group_size: int) -> Tensor:
    """``(P,)`` each group's sample std over its scored rewards; NaN when fewer than two are scored (TRL's
    ``nanstd``, trl/trainer/utils.py: Bessel's correction count / (count - 1) is NaN for count <= 1)."""
    r, ok = _groups(rewards, group_size)
    std = _masked_std(r, ok, _group_mean(r, ok), dim=1).squeeze(1)
    return torch.where(ok.sum(1) > 1, std, torch.full_like(std, float("nan")))


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: Tensor, group_size: int, *, scale_rewards: str = "group") -> Tensor:
    """A_i = (r_i - mean_group) / (std + 1e-4); std of the group (``group``), of all scored rewards of
    the iteration (``batch``), or no scaling (``none``: A_i = r_i - mean_group)."""
    r, ok = _groups(rewards, group_size)
    mean = _group_mean(r, ok)
    centred = r - mean
    if scale_rewards == "group":
        centred = centred / (_masked_std(r, ok, mean, dim=1) + STD_EPS)
    elif scale_rewards == "batch":
        flat_mean = r.sum() / ok.sum().clamp_min(1)
        centred = centred / (_masked_std(r, ok, flat_mean, dim=None) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    return torch.where(ok, centred, torch.zeros_like(centred)).reshape(-1).float()


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, group_size: int, **_: object) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_group (no division by the std: no question-difficulty bias)."""
    return grpo_advantages(rewards, group_size, scale_rewards="none")


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: Tensor, group_size: int, **_: object) -> Tensor:
    """RLOO: A_i = r_i - mean of the OTHER scored rewards of the group (0 if none)."""
    r, ok = _groups(rewards, group_size)
    n = ok.sum(1, keepdim=True)
    others = (r.sum(1, keepdim=True) - r) / (n - 1).clamp_min(1)
    adv = torch.where(ok & (n > 1), r - others, torch.zeros_like(r))
    return adv.reshape(-1).float()


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over ``(B, T)`` per-token rewards and values (positions with
    ``mask == 0`` are padding after the sequence's end: their value counts as 0).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  returns = A + V."""
    values = values * mask
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, adv + values


def whiten(x: Tensor, mean: float, var: float, *, shift_mean: bool = True) -> Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with statistics the caller reduced over every rank."""
    out = (x - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=x.dtype))
    return out if shift_mean else out + mean


def group_advantages(rewards: Tensor, group_size: int, *, estimator: str = "grpo", statistics: str = "prompt",
                     scale_rewards: str = "group", clip: float = 0.0) -> Tensor:
    """``(N,)`` advantages from the gathered rewards: ``statistics`` ``prompt`` = per group of ``group_size``
    (with ``scale_rewards`` group | batch | none, ``batch`` being Flow-GRPO's per-prompt mean with the global
    std), ``global`` = the whole batch as one group (mean and std of every reward). ``clip`` > 0 clamps to
    +-clip. NaN rewards get 0."""
    if statistics == "global":
        group_size, scale_rewards = rewards.numel(), "none" if scale_rewards == "none" else "group"
    elif statistics != "prompt":
        raise ValueError(f"statistics must be prompt or global, got {statistics!r}")
    adv = ADVANTAGES.get(estimator)(rewards, group_size, scale_rewards=scale_rewards)
    return adv.clamp(-clip, clip) if clip > 0 else adv


@dataclass(frozen=True)
class GroupAdvantages:
    """An online algorithm's advantage part: the ``estimator`` (``ADVANTAGES``) over groups of ``group_size``
    contiguous rewards (``statistics: prompt``) or the whole batch (``global``), with ``scale_rewards`` and the
    clip (0 = off) of :func:`group_advantages`. GRPO / RLOO / Dr. GRPO, red-team RL and Flow-GRPO each build one
    from their own section."""

    estimator: str
    group_size: int
    scale_rewards: str = "group"
    statistics: str = "prompt"
    clip: float = 0.0

    def __call__(self, rewards: Tensor) -> Tensor:
        """``(N,)`` advantages of the gathered ``(N,)`` rewards (the same on every rank); NaN rewards get 0."""
        return group_advantages(rewards, self.group_size, estimator=self.estimator, statistics=self.statistics,
                                scale_rewards=self.scale_rewards, clip=self.clip)
