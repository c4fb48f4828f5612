"""``ppo_agent``'s advantage (issue 48, C): GAE over the policy's ids of a trajectory with the environment's ids
left out, each turn's reward at its last policy id; hand-computed."""

from __future__ import annotations

import pytest

from alignkit.rollout.agents.credit import policy_token_gae, turn_token_rewards


def test_turn_rewards_sit_on_each_turns_last_policy_id() -> None:
    # ids: P P E E P P P E P  (turns: [0, 2), [4, 7), [8, 9))
    spans = [(0, 2), (4, 7), (8, 9)]
    assert turn_token_rewards(9, spans, [0.5, 0.0, 1.0]) == [0, 0.5, 0, 0, 0, 0, 0.0, 0, 1.0]
    # an empty turn's reward goes to the policy id before it; with none before, it is lost
    assert turn_token_rewards(4, [(0, 2), (4, 4)], [1.0, 2.0]) == [0, 3.0, 0, 0]
    assert turn_token_rewards(2, [(0, 0)], [1.0]) == [0, 0]


def test_gae_skips_the_environment_ids() -> None:
    """Trajectory ``P0 P1 E2 E3 P4 P5`` (E: the environment's reply), gamma 0.9, lam 0.5; turn rewards 0.2 at P1
    (the tool turn) and 1 at P5 (the answer), KL rewards -0.1 on every policy id; values V = [0.5, 0.6, 9, 9, 0.7,
    0.8] (the 9s, at environment ids, must not enter).

    Over the policy ids (P0, P1, P4, P5): r = [-0.1, 0.1, -0.1, 0.9], V = [0.5, 0.6, 0.7, 0.8], next V = [0.6,
    0.7, 0.8, 0]:
    delta = [-0.1 + 0.54 - 0.5, 0.1 + 0.63 - 0.6, -0.1 + 0.72 - 0.7, 0.9 - 0.8] = [-0.06, 0.13, -0.08, 0.1]
    A(P5) = 0.1; A(P4) = -0.08 + 0.45 * 0.1 = -0.035; A(P1) = 0.13 + 0.45 * -0.035 = 0.11425;
    A(P0) = -0.06 + 0.45 * 0.11425 = -0.0085875. Returns = A + V."""
    mask = [1, 1, 0, 0, 1, 1]
    rewards = [-0.1 + r for r in turn_token_rewards(6, [(0, 2), (4, 6)], [0.2, 1.0])]
    rewards = [r if m else 0.0 for r, m in zip(rewards, mask)]
    values = [0.5, 0.6, 9.0, 9.0, 0.7, 0.8]
    adv, ret = policy_token_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    want = [-0.0085875, 0.11425, 0.0, 0.0, -0.035, 0.1]
    assert adv == pytest.approx(want, abs=1e-12)
    assert ret == pytest.approx([a + v if m else v for a, v, m in zip(want, values, mask)], abs=1e-12)
    # rewards at the environment's ids are not the policy's: they change nothing
    noisy = [r + (5.0 if not m else 0.0) for r, m in zip(rewards, mask)]
    assert policy_token_gae(noisy, values, mask, gamma=0.9, lam=0.5)[0] == pytest.approx(want, abs=1e-12)


def test_gae_of_a_single_turn_is_plain_gae_and_no_policy_ids_is_zero() -> None:
    import torch

    from alignkit.rollout.advantages import gae

    r, v = [0.0, 0.0, 1.0], [0.1, 0.2, 0.3]
    adv, ret = policy_token_gae(r, v, [1, 1, 1], gamma=1.0, lam=0.95)
    a, g = gae(torch.tensor([r]), torch.tensor([v]), torch.ones(1, 3), gamma=1.0, lam=0.95)
    assert adv == pytest.approx(a[0].tolist()) and ret == pytest.approx(g[0].tolist())
    assert policy_token_gae(r, v, [0, 0, 0], gamma=1.0, lam=0.95) == ([0.0] * 3, v)


def test_logged_kl_of_make_experience_counts_the_policy_ids_only() -> None:
    """Issue 48: ``ppo_agent``'s experience logs kl (k1 = old - ref) over the policy's ids. Trajectory 1 ``P E P``:
    old [0, -1, 0], ref [-0.1, -3, -0.3] -> KL [0.1, 2.0, 0.3]; trajectory 2 ``P E``: old [0, 0], ref [-0.4, -7]
    -> KL [0.4, 7.0]. Logged: (0.1 + 0.3 + 0.4) / 3 = 0.2667 (over every id it would be 9.8 / 5 = 1.96). The
    models' forwards are stand-ins (the numbers above); the rest is the algorithm's own code."""
    from types import SimpleNamespace

    import torch

    import alignkit.algorithms  # noqa: F401  (registers the algorithms and their sections)
    from alignkit.algorithms.agent_ppo import AgentPPO
    from alignkit.config import load_config

    algo = object.__new__(AgentPPO)
    algo.cfg = load_config(None, ["algorithm=ppo_agent", "model.name_or_path=none", "ppo.kl_coef=0.1",
                                  "data.train=builtin:calculator_prompts_train.jsonl", "training.per_device_batch_size=2"])
    forwards = {"policy": [[0.0, -1.0, 0.0], [0.0, 0.0]], "reference": [[-0.1, -3.0, -0.3], [-0.4, -7.0]]}
    algo.tokens = SimpleNamespace(logps=lambda ctx, batches, role="policy": forwards[role])
    algo._values = lambda ctx, role, batches: [[0.0] * 3, [0.0] * 2]
    samples = [{"completion_ids": [1, 2, 3], "loss_mask": [1.0, 0.0, 1.0], "turn_rewards": [0.0, 0.0, 1.0]},
               {"completion_ids": [1, 2], "loss_mask": [1.0, 0.0], "turn_rewards": [0.0, 0.0]}]
    stats = algo.make_experience(SimpleNamespace(mine=slice(0, 2)), samples, [], {"reward": torch.tensor([1.0, 0.0])})
    assert stats.means()["kl"] == pytest.approx(0.8 / 3, abs=1e-7)  # KL in float32
    assert samples[0]["kl"] == pytest.approx([0.1, 2.0, 0.3])  # the env id's KL is there, just not counted
