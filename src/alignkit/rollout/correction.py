"""The ``off_policy:`` section: how the loss corrects for samples drawn by a behaviour policy other than the
trainer's proximal one (a generator some policy versions behind, asynchronous RL), from the behaviour log-probs a
sample carries per token (``sampler_logps``). The weights are losses/rl.py ``sampler_is_weights`` and the update
is then the decoupled objective (``decoupled_surrogate``): the clip against the trainer's recomputed old
log-probs (the proximal policy), the weight pi_prox / pi_behav to the behaviour policy. An engine that corrects
for its own sampler (``vllm.importance_sampling_*``) keeps its own settings; these apply to the others (``hf``).
Every online algorithm reads it (``algorithms/online.py``); samples without ``sampler_logps`` are not weighted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from alignkit.config.schema import f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError

Correction = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                     "sequence_geo_mask"]


@register_section("off_policy")
@dataclass
class OffPolicyConfig:
    correction: Correction = f(
        "token_truncate", "Weight of a token sampled by the behaviour policy, from r = pi_old / pi_behav: "
        "token_truncate min(r, cap) (token TIS); token_mask r, 0 above cap (MIS); sequence_truncate / "
        "sequence_mask the same on the sequence's product of ratios; icepop r inside [low, cap], 0 outside (IcePop); "
        "sequence_geo_mask 1, or 0 for a sequence whose exp(mean_t log r) is outside [low, cap]; none = weight 1. "
        "Default from benchmarks/learn_addition.py, 16 seeds at staleness 4 (docs/workflows/async-rl.md).")
    cap: float = f(2.0, "Upper bound of the ratio (the truncation cap, or the mask's upper edge).", gt=0)
    low: float = f(0.5, "Lower edge of icepop's and sequence_geo_mask's band [low, cap] (the others ignore it).",
                   ge=0)

    def __post_init__(self) -> None:
        if self.low >= self.cap:
            raise ConfigError(f"off_policy.low ({self.low}) must be below off_policy.cap ({self.cap}): the band "
                              "[low, cap] of kept ratios would be empty")
