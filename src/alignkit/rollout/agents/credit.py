"""Advantages of a multi-turn trajectory's tokens (``agent.credit``).

``trajectory``: every policy token of trajectory i carries its group-relative advantage A_i of the return
R_i = sum_k r_{i,k} (the estimator of the run: grpo / rloo / dr_grpo).
``turn``: the tokens of turn k carry the advantage the estimator gives trajectory i when its return is the
reward-to-go G_{i,k} = sum_{j >= k} r_{i,j} (the other trajectories' returns unchanged): a turn is credited only
with the rewards at or after it. With only a final reward G_{i,k} = R_i and the two coincide.
The multi-turn red team's ``redteam.turn_credit: turn`` is ``turn`` with discounted returns (``gamma``).
``ppo_agent`` (a critic): GAE over the policy's ids with the environment's ids left out, turn k's reward at its
last policy id (:func:`turn_token_rewards`, :func:`policy_token_gae`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from alignkit.rollout.advantages import gae

CREDITS = ("trajectory", "turn")


def rewards_to_go(rewards: Any, gamma: float = 1.0) -> list[Any]:
    """``G_k = rewards[k] + gamma G_{k+1}`` for every k (gamma 1: ``sum(rewards[k:])``). ``rewards``: floats, or
    tensors (a tensor row's 0-d entries, or ``(N,)`` columns for N trajectories at once): tensors stay tensors."""
    out, acc = [], 0.0
    for r in reversed(rewards):
        acc = r + gamma * acc
        out.append(acc)
    return out[::-1]


def turn_advantages(estimator: Callable[[torch.Tensor], torch.Tensor], returns: torch.Tensor, index: int,
                    turn_rewards: Any, gamma: float = 1.0) -> list[float]:
    """Per turn of trajectory ``index`` (global position in the ``(N,)`` gathered ``returns``), the advantage
    ``estimator`` gives it with its return replaced by the turn's (``gamma``-discounted) reward-to-go; read back
    to the host once (``turn_rewards`` may be a tensor row)."""
    out = []
    for g in rewards_to_go(turn_rewards, gamma):
        r = returns.clone()
        r[index] = g
        out.append(estimator(r)[index])
    return torch.stack(out).tolist() if out else []


def turn_token_values(t: Any, per_turn: list[float]) -> list[float]:
    """One value per completion id of ``t`` (an agent's trajectory or a red-team conversation: its ``completion_ids``
    and ``turn_spans``): turn k's value on its policy ids, 0 on the environment's (masked anyway)."""
    out = [0.0] * len(t.completion_ids)
    for (start, end), v in zip(t.turn_spans, per_turn):
        out[start:end] = [v] * (end - start)
    return out


def turn_token_rewards(n: int, turn_spans: list[tuple[int, int]], turn_rewards: list[float]) -> list[float]:
    """``n`` per-token rewards of a trajectory's completion ids: turn k's reward on its LAST policy id (the end of
    its span; an empty turn's reward goes to the policy id before it, or is lost when there is none), 0 elsewhere."""
    out = [0.0] * n
    last = -1
    for (start, end), r in zip(turn_spans, turn_rewards):
        last = end - 1 if end > start else last
        if last >= 0:
            out[last] += r
    return out


def policy_token_gae(rewards: list[float], values: list[float], policy_mask: list[float], *, gamma: float,
                     lam: float) -> tuple[list[float], list[float]]:
    """GAE over the policy's ids only (``policy_mask`` 1): the environment's ids are not steps of the policy's
    decision process, so they are left out and the policy id after a reply bootstraps the one before it
    (delta_t = r_t + gamma V_next - V_t, next = the next POLICY id, 0 after the last). Returns (advantages,
    returns) per completion id; at an environment id the advantage is 0 and the return its own value (neither is
    trained: ``loss_mask`` 0 there)."""
    keep = [i for i, m in enumerate(policy_mask) if m > 0]
    adv, ret = [0.0] * len(values), list(values)
    if not keep:
        return adv, ret
    v = torch.tensor([[values[i] for i in keep]], dtype=torch.float64)
    r = torch.tensor([[rewards[i] for i in keep]], dtype=torch.float64)
    a, g = gae(r, v, torch.ones_like(v), gamma=gamma, lam=lam)
    for j, i in enumerate(keep):
        adv[i], ret[i] = float(a[0, j]), float(g[0, j])
    return adv, ret
