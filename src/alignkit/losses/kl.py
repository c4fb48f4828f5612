"""Sampled KL(pi || pi_ref) estimators (Schulman, "Approximating KL divergence"; ALGORITHMS 4).

With y ~ pi and L = log pi(y) - log pi_ref(y) per token:
  k1 = L                    unbiased, can be negative (use as a reward penalty)
  k2 = L^2 / 2              biased, low variance
  k3 = e^{-L} - 1 + L       unbiased and >= 0 (use as a loss term)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from alignkit.registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("kl estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def _k3(log_ratio: Tensor) -> Tensor:
    # expm1 keeps precision when L is near 0, where k3 ~ L^2/2 is tiny
    return torch.expm1(-log_ratio) + log_ratio


def kl_estimate(logps: Tensor, ref_logps: Tensor, kind: str = "k1") -> Tensor:
    """Elementwise KL estimate; shapes ``(B, T)`` -> ``(B, T)`` (reduce with ``ops.masked_mean``).

    Args:
        logps: log-probs of the sampled tokens under the policy.
        ref_logps: the same tokens under the reference model.
        kind: ``"k1"``, ``"k2"`` or ``"k3"`` (``KL_ESTIMATORS.names()``).
    """
    return KL_ESTIMATORS.get(kind)(logps - ref_logps)
