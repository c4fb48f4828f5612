"""``group_experience``: a group-relative experience built from its inputs alone (rewards, this rank's slice,
the forwards' log-probs), with no model, context or process group; the numbers by hand."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.algorithms.grpo import group_experience
from alignkit.rollout.advantages import GroupAdvantages


def samples_of(*lengths: int) -> list[dict]:
    return [{"prompt_ids": [1], "completion_ids": [7] * n} for n in lengths]


def test_this_ranks_slice_gets_its_groups_advantages_on_every_token() -> None:
    # two groups of two, gathered: (1, 3) and (2, 2); grpo: (r - mean) / (std + 1e-4), std Bessel-corrected
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    samples = samples_of(2, 3)  # this rank holds completions 1 and 2 (global order)
    stats, adv = group_experience(samples, rewards, slice(1, 3), GroupAdvantages("grpo", 2, "group"))
    a = 1.0 / (math.sqrt(2.0) + 1e-4)
    assert samples[0]["advantages"] == pytest.approx([a, a]) and samples[1]["advantages"] == [0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx([-a, a, 0.0, 0.0])  # every rank's, for records such as attacks.jsonl
    assert "ref_logps" not in samples[0] and "old_logps" not in samples[0]
    means = stats.means()
    assert means["frac_reward_zero_std"] == 0.5 and means["advantage_abs_max"] == pytest.approx(a)
    assert means["reward_std"] == pytest.approx(torch.tensor([1.0, 3.0, 2.0, 2.0]).std().item())


def test_the_given_log_probs_are_stored_per_sample() -> None:
    samples = samples_of(1, 2)
    group_experience(samples, torch.tensor([0.0, 1.0]), slice(0, 2), GroupAdvantages("dr_grpo", 2, "none"),
                     ref_logps=[[-1.0], [-2.0, -3.0]], old_logps=[[-0.5], [-0.25, -0.125]])
    assert [s["advantages"] for s in samples] == [[-0.5], [0.5, 0.5]]  # dr_grpo: r - mean
    assert [s["ref_logps"] for s in samples] == [[-1.0], [-2.0, -3.0]]
    assert [s["old_logps"] for s in samples] == [[-0.5], [-0.25, -0.125]]
