"""The GRPO family's config values: CISPO, the overlong punishment, the off-policy correction section."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import alignkit.algorithms  # noqa: F401 - registrations
from alignkit.algorithms.grpo import GRPO
from alignkit.algorithms.token_rollout import TokenRollout
from alignkit.config.loader import load_config
from alignkit.errors import ConfigError


def cfg(tmp_path, *overrides):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: grpo\nmodel: {name_or_path: tiny}\ndata: {train: builtin:digits_prompts_train.jsonl}\n"
                    "training: {per_device_batch_size: 8}\nrollout: {num_generations: 4, max_new_tokens: 8}\n")
    return load_config(path, list(overrides))


def test_off_policy_correction_reaches_the_token_part(tmp_path):
    sampling = TokenRollout(cfg(tmp_path, "off_policy.correction=sequence_geo_mask", "off_policy.low=0.7")).importance_sampling()
    assert (sampling.mode, sampling.cap, sampling.low) == ("sequence_geo_mask", 2.0, 0.7)
    assert TokenRollout(cfg(tmp_path, "off_policy.correction=none")).importance_sampling() is None
    with pytest.raises(ConfigError, match="off_policy.low"):
        cfg(tmp_path, "off_policy.low=3")


def test_cispo_and_overlong_keys(tmp_path):
    with pytest.raises(ConfigError, match="importance_sampling_level: token"):
        cfg(tmp_path, "grpo.objective=cispo", "grpo.importance_sampling_level=sequence")
    with pytest.raises(ConfigError, match="overlong_buffer"):
        cfg(tmp_path, "grpo.overlong_buffer=9")
    c = cfg(tmp_path, "grpo.overlong_buffer=4", "grpo.overlong_penalty=0.5")
    assert c.grpo.overlong_buffer == 4
    assert GRPO.check_config(c) is None


def test_grpo_reward_signal_adds_the_overlong_penalty(tmp_path):
    from alignkit.rewards.signals import ScoreInputs

    algo = GRPO(cfg(tmp_path, "grpo.overlong_buffer=4", "grpo.overlong_penalty=0.5"), SimpleNamespace(pad_token_id=0, eos_token_id=1))
    inputs = ScoreInputs(prompts=["a"] * 3, completions=["x"] * 3, lengths=[2, 6, 8], fields=[{}] * 3, batches=[])
    total = algo.signals()["reward"].score(None, inputs, None, placement="local")["total"]
    assert total == [0.0, -0.25, -0.5]  # max_new_tokens 8, buffer 4: 0 to 4 tokens, -0.5 x (n - 4) / 4 after


def test_dynamic_sampling_selects_groups_with_a_spread_then_fills():
    import torch

    from alignkit.algorithms.dynamic_sampling import has_spread, select_groups

    nan = float("nan")
    first = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, nan, 1.0])  # groups of 2: agree, spread, agree, one scored
    second = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5])  # spread, agree, spread, agree
    assert has_spread(first, 2).tolist() == [False, True, False, False]
    # 4 groups needed: round 0 group 1, round 1 groups 0 and 2 have a spread; one filler: the first agreeing group
    assert select_groups([first, second], 2, 4) == ([(0, 0), (0, 1), (1, 0), (1, 2)], 1)
    assert select_groups([second], 2, 2) == ([(0, 0), (0, 2)], 0)  # enough in one round: no filler


def test_grpo_update_with_behaviour_logps_is_the_decoupled_objective(tmp_path):
    """GRPO's loss on samples carrying ``sampler_logps`` equals losses/rl.py ``decoupled_surrogate`` (clip against
    the stored old log-probs, the proximal policy; IcePop weight to the behaviour policy) aggregated by sequence."""
    import torch

    from alignkit.losses.rl import aggregate, decoupled_surrogate
    from alignkit.rollout.experience import collate_samples

    algo = GRPO(cfg(tmp_path, "rollout.update_epochs=2", "off_policy.correction=icepop"),
                SimpleNamespace(pad_token_id=0, eos_token_id=1))
    samples = [{"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "advantages": [1.0] * 3,
                "old_logps": [-1.0, -0.5, -2.0], "sampler_logps": [-1.2, -2.0, -1.9]},
               {"prompt_ids": [5], "completion_ids": [4, 3], "advantages": [-0.5] * 2,
                "old_logps": [-0.3, -1.0], "sampler_logps": [-0.1, -1.1]}]
    batch = collate_samples(samples, 0)
    new = torch.tensor([-0.9, -0.4, -2.5, -0.2, -1.3])  # the current policy's log-probs of the 5 tokens

    class Stub:
        def logps(self, role, b, **kw):
            return new, torch.zeros(5)

    loss, metrics = algo.loss(Stub(), batch, normalizer=2.0)
    seq = torch.tensor([0, 0, 0, 1, 1])
    old = torch.tensor([-1.0, -0.5, -2.0, -0.3, -1.0])
    behav = torch.tensor([-1.2, -2.0, -1.9, -0.1, -1.1])
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5])
    per_token, _, w = decoupled_surrogate(new, old, behav, adv, eps_low=0.2, eps_high=0.2, correction="icepop",
                                          cap=2.0, low=0.5)
    assert w.tolist()[1] == 0.0 and w.tolist()[0] > 0  # pi_old / pi_behav = e^1.5 > 2: masked; e^0.2: kept
    assert torch.allclose(loss, aggregate(per_token, seq, 2, mode="sequence_mean", normalizer=2.0))
    assert abs(metrics.means()["sampler_is_masked"] - 0.2) < 1e-9  # 1 of the 5 tokens
