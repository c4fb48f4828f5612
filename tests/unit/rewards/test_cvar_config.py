"""The shared CVaR section type (rewards/cvar.py ``CVaRConfig``) and the advantage part (rollout/advantages.py
``GroupAdvantages``) that red-team RL and Flow-GRPO are built from."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from alignkit.algorithms.flow_grpo import FlowGRPOConfig
from alignkit.algorithms.redteam import RedTeamConfig
from alignkit.config import load_config
from alignkit.errors import ConfigError
from alignkit.rewards.cvar import CVaRConfig, redteam_reward
from alignkit.rollout.advantages import ADVANTAGES, GroupAdvantages
from tests.conftest import REPO

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_both_sections_read_the_same_keys_with_their_own_defaults() -> None:
    keys = [f.name for f in dataclasses.fields(CVaRConfig)]
    assert keys == ["tau", "w_cvar", "w_quality"]
    for section in (RedTeamConfig, FlowGRPOConfig):
        assert issubclass(section, CVaRConfig) and [f.name for f in dataclasses.fields(section)][:3] == keys
    assert (RedTeamConfig.w_cvar, RedTeamConfig.w_quality) == (0.1, 0.05)
    assert (FlowGRPOConfig().w_cvar, FlowGRPOConfig().w_quality) == (0.0, 1.0)  # flow_grpo: no tail bonus by default
    cfg = load_config(REPO / "configs" / "flow_rtpo.yaml", ["redteam.tau=0.3", "flow_grpo.w_quality=0.5"])
    assert cfg.section(RedTeamConfig).tau == 0.3 and cfg.section(FlowGRPOConfig).w_quality == 0.5  # users' keys


@pytest.mark.parametrize("section,config", [("redteam", "redteam.yaml"), ("flow_grpo", "flow_grpo.yaml")])
def test_a_tail_level_of_one_is_refused_naming_its_section(section: str, config: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.tau: expected a value in \(0, 1\), got 1\.0"):
        load_config(REPO / "configs" / config, [f"{section}.tau=1.0"])


def test_reward_is_the_cvar_reward_with_the_sections_weights() -> None:
    tox, q = T(0.1, 0.9, 0.5, 0.7), T(1.0, 0.0, 0.5, 0.25)
    c = CVaRConfig(tau=0.5, w_cvar=0.5, w_quality=0.2)
    got = c.reward(tox, q)
    want = redteam_reward(tox, q, tau=0.5, w_cvar=0.5, w_quality=0.2)
    assert torch.equal(got["reward"], want["reward"]) and got["var"] == want["var"]
    # by hand: VaR = lower 0.5-quantile (0.5) - 0.01 x range 0.8 = 0.492; bonus max(0, tox - VaR)
    assert got["reward"].tolist() == pytest.approx([0.1 + 0.2, 0.9 + 0.5 * 0.408, 0.5 + 0.5 * 0.008 + 0.1,
                                                    0.7 + 0.5 * 0.208 + 0.05])
    alone = c.reward(tox)  # no quality term: its weight is not applied
    assert torch.equal(alone["reward"], redteam_reward(tox, None, tau=0.5, w_cvar=0.5, w_quality=0.0)["reward"])


def test_group_advantages_per_prompt_unclipped_are_the_estimators() -> None:
    r = T(1.0, 3.0, 2.0, 2.0, math.nan, 5.0)
    for name in ("grpo", "rloo", "dr_grpo"):
        assert torch.equal(GroupAdvantages(name, 2)(r), ADVANTAGES.get(name)(r, 2, scale_rewards="group"))
    clipped = GroupAdvantages("grpo", 6, statistics="global", clip=0.5)(T(0.0, 0.0, 0.0, 0.0, 0.0, 100.0))
    assert clipped.max() == 0.5 and clipped.min() >= -0.5
