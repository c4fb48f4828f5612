"""The Lagrange multiplier's update (Safe RLHF, ALGORITHMS 1.3), a pure function.

ln lambda_{k+1} = ln lambda_k + lr * lambda_k * (J_C - threshold), clamped to ln lambda_max: the
multiplier grows while the measured cost J_C exceeds the threshold and shrinks below it. Callers pass
a J_C that is the same on every rank (reduced over ranks), so every rank holds the same lambda.
"""

from __future__ import annotations

import math


def update_log_lambda(log_lambda: float, cost: float, *, threshold: float, lr: float, lambda_max: float) -> float:
    """The next ln lambda (a NaN cost, e.g. nothing scored, leaves it unchanged)."""
    if math.isnan(cost):
        return log_lambda
    return min(log_lambda + lr * math.exp(log_lambda) * (cost - threshold), math.log(lambda_max))
