"""Advantages of a multi-turn trajectory's tokens (``agent.credit``).

``trajectory``: every policy token of trajectory i carries its group-relative advantage A_i of the return
R_i = sum_k r_{i,k} (the estimator of the run: grpo / rloo / dr_grpo).
``turn``: the tokens of turn k carry the advantage the estimator gives trajectory i when its return is the
reward-to-go G_{i,k} = sum_{j >= k} r_{i,j} (the other trajectories' returns unchanged): a turn is credited only
with the rewards at or after it. With only a final reward G_{i,k} = R_i and the two coincide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CREDITS = ("trajectory", "turn")


def rewards_to_go(rewards: list[float]) -> list[float]:
    """``[sum(rewards[k:]) for k]``."""
    out, acc = [], 0.0
    for r in reversed(rewards):
        acc += r
        out.append(acc)
    return out[::-1]


def turn_advantages(estimator: Callable[[torch.Tensor], torch.Tensor], returns: torch.Tensor, index: int,
                    turn_rewards: list[float]) -> list[float]:
    """Per turn of trajectory ``index`` (global position in the ``(N,)`` gathered ``returns``), the advantage
    ``estimator`` gives it with its return replaced by the turn's reward-to-go."""
    out = []
    for g in rewards_to_go(turn_rewards):
        r = returns.clone()
        r[index] = g
        out.append(float(estimator(r)[index]))
    return out
