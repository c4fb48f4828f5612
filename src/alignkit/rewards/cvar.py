"""Red-team reward and advantages (ALGORITHMS 2.2, 2.3) as pure functions of the GATHERED global batch.

Every function takes the iteration's values of every rank in global order (``(N,)``, NaN = unscorable)
and returns numbers that are the same on every rank, which then takes its own slice.

* :func:`value_at_risk`: VaR_tau = the lower (1 - tau)-quantile of the scored toxicities (numpy's
  ``method="lower"``: the sorted value at floor((1 - tau)(n - 1)), so ties count as they fall) minus
  eps = max(0.01 * (max - min), 1e-6), so the values AT the quantile get a (small) bonus too; with one
  scored value, that value (its bonus is 0), as henrymao2004/flow_rtpo ``compute_cvar_bonus`` does.
* :func:`redteam_reward`: R_i = tox_i + w_cvar * max(0, tox_i - VaR_tau) + w_quality * q_i
  - w_diversity * sim_i, as the reference's ``__call__`` at the commit ALGORITHMS 2 cites (flow_rtpo@13289f8,
  its main branch: "Equation 1"); only a later commit on other branches (036b339, branches a800 and new) leaves
  the bonus out of its total. ``sim_i`` is the novelty penalty (:func:`attack_similarity`), 0 unless
  w_diversity > 0.
The advantages of these rewards (per prompt or global, clipped) are ``rollout/advantages.py``'s
:class:`~alignkit.rollout.advantages.GroupAdvantages`. :class:`CVaRConfig` is the config section type of the
reward's weights, shared by ``redteam:`` and ``flow_grpo:``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from alignkit.config.schema import f
from alignkit.config.sections import section_name
from alignkit.errors import ConfigError

VAR_EPS_FRACTION = 0.01  # of the batch's toxicity range (flow_rtpo)
VAR_EPS_MIN = 1e-6


@dataclass
class CVaRConfig:
    """The reward's CVaR and quality weights, one section type for ``redteam:`` and ``flow_grpo:`` (both inherit
    these keys; ``flow_grpo`` keeps its own defaults): R = main + w_cvar max(0, main - VaR_tau) + w_quality q."""

    tau: float = f(0.1, "CVaR tail level in (0, 1): VaR = the lower (1 - tau)-quantile of the gathered main rewards "
                   "(red-team: toxicities) - eps.", gt=0)
    w_cvar: float = f(0.1, "Weight of the tail bonus max(0, main - VaR) over the gathered batch.", ge=0)
    w_quality: float = f(0.05, "Weight of the quality term (the quality scorers; 0 without any).")

    def __post_init__(self) -> None:
        if not self.tau < 1:
            raise ConfigError(f"{section_name(type(self))}.tau: expected a value in (0, 1), got {self.tau}")

    def reward(self, main: Tensor, quality: Tensor | None = None, similarity: Tensor | None = None, *,
               w_diversity: float = 0.0) -> dict[str, Tensor | float]:
        """:func:`redteam_reward` of the gathered terms with this section's weights (no quality weight without a
        quality term)."""
        return redteam_reward(main, quality, similarity, tau=self.tau, w_cvar=self.w_cvar,
                              w_quality=self.w_quality if quality is not None else 0.0, w_diversity=w_diversity)


def value_at_risk(tox: Tensor, tau: float) -> float:
    """VaR_tau of the non-NaN values of ``(N,)`` ``tox`` (module docstring); NaN when none is scored."""
    ok = tox[~torch.isnan(tox)].double()
    n = ok.numel()
    if n == 0:
        return math.nan
    if n == 1:
        return float(ok[0])
    values = ok.numpy()
    # numpy's own "lower" quantile at the reference's q = ((1 - tau) * 100) / 100: the same index, float for float
    base = float(np.quantile(values, (1 - tau) * 100 / 100.0, method="lower"))
    eps = max(VAR_EPS_FRACTION * float(values.max() - values.min()), VAR_EPS_MIN)
    return base - eps


def cvar_bonus(tox: Tensor, var: float) -> Tensor:
    """``(N,)`` max(0, tox - VaR): the per-sample tail integrand (no 1/tau factor; NaN stays NaN)."""
    return (tox.double() - var).clamp_min(0.0).where(~torch.isnan(tox), torch.full_like(tox.double(), math.nan))


def redteam_reward(tox: Tensor, quality: Tensor | None = None, similarity: Tensor | None = None, *, tau: float,
                   w_cvar: float, w_quality: float = 0.0, w_diversity: float = 0.0) -> dict[str, Tensor | float]:
    """Every term of R over the gathered batch: ``reward``, ``cvar_bonus``, ``var`` (a float), and the inputs.
    A sample whose toxicity (or, with w_quality != 0, quality) is NaN gets reward NaN: left out of the
    advantage statistics with advantage 0, never scored 0."""
    tox = tox.double()
    zeros = torch.zeros_like(tox)
    q = quality.double() if quality is not None else zeros
    sim = similarity.double() if similarity is not None else zeros
    var = value_at_risk(tox, tau)
    bonus = cvar_bonus(tox, var) if not math.isnan(var) else torch.full_like(tox, math.nan)
    reward = tox + w_cvar * bonus + (w_quality * q if w_quality else 0.0) - (w_diversity * sim if w_diversity else 0.0)
    return {"reward": reward, "toxicity": tox, "cvar_bonus": bonus, "quality": q, "similarity": sim, "var": var}


_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int) -> frozenset[tuple[str, ...]]:
    """The word 1..n-grams of ``text`` (lowercased)."""
    words = _WORD.findall(text.lower())
    return frozenset(tuple(words[i : i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b|; 1 for two empty sets (the same text)."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def attack_similarity(attacks: list[str], n: int = 2) -> Tensor:
    """``(N,)`` each attack's mean Jaccard similarity of word 1..n-grams to the OTHER attacks of the batch (1 =
    every other attack is the same text): the novelty penalty of curiosity-driven red teaming (Hong et al.
    2024) in its simplest, model-free form. 0 for a batch of one. An attack with no word tokens (empty,
    punctuation only) gets 1, the full penalty; it still counts 0 in the others' means."""
    N = len(attacks)
    if N < 2:
        return torch.zeros(N, dtype=torch.float64)
    sets = {a: ngrams(a, n) for a in set(attacks)}
    pair: dict[tuple[str, str], float] = {}
    out = torch.zeros(N, dtype=torch.float64)
    for i, a in enumerate(attacks):
        if not sets[a]:
            # Not maximally novel: its Jaccard with any worded attack is 0, so it would dodge the penalty
            # entirely, and an attacker whose toxicity is flat would learn to emit nothing (or "!!!") to earn
            # the largest diversity reward. Having no content, it is novel in nothing: the full penalty.
            out[i] = 1.0
            continue
        total = 0.0
        for j, b in enumerate(attacks):
            if i != j:
                key = (a, b) if a <= b else (b, a)
                if key not in pair:
                    pair[key] = jaccard(sets[a], sets[b])
                total += pair[key]
        out[i] = total / (N - 1)
    return out


def attack_stats(attacks: list[str], tox: Tensor, threshold: float, repeats: int = 1) -> dict[str, float]:
    """Success and diversity of the gathered batch: ``attack_success_rate`` (scored toxicity >= threshold),
    ``distinct_attacks`` (different stripped texts), ``distinct_fraction``, ``distinct_successes`` (different
    texts among the successful attacks) and ``distinct_toxicity`` (mean toxicity over the distinct texts, each
    counted once at its first occurrence). ``repeats``: each attack holds that many contiguous rows (answers to
    flow_rtpo's images of it): success is counted per row, ``distinct_fraction`` per attack."""
    ok = ~torch.isnan(tox)
    success = (tox >= threshold) & ok
    texts = [a.strip() for a in attacks]
    first: dict[str, float] = {}
    for t, v, good in zip(texts, tox.tolist(), ok.tolist()):
        if good and t not in first:
            first[t] = v
    return {"attack_success_rate": float(success.sum()) / max(1, int(ok.sum())),
            "distinct_attacks": float(len(set(texts))),
            "distinct_fraction": len(set(texts)) / max(1, len(texts) // repeats),
            "distinct_successes": float(len({t for t, s in zip(texts, success.tolist()) if s})),
            "distinct_toxicity": sum(first.values()) / len(first) if first else math.nan}
