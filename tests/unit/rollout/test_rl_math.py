"""Hand-computed values for the online algorithms' pure math: advantage estimators, policy / value
losses, aggregation, KL estimators, reward combination and the Lagrange multiplier update."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses.rl import aggregate, clipped_surrogate, clipped_value_loss, sampler_is_weights
from alignkit.rewards.functions import REWARD_FUNCTIONS, RewardFunctionError, WeightedFunction, call, combine
from alignkit.rollout.advantages import ADVANTAGES, gae, whiten

nan = math.nan


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# ---------------------------------------------------------------- advantages
def test_grpo_group_scaling():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])  # groups of 3: [1,0,0], [0,2,4]
    # group 1: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s1 = math.sqrt(1 / 3)
    # group 2: mean 2, std sqrt((4 + 0 + 4) / 2) = 2
    want = [(2 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), -2 / 2.0001, 0.0, 2 / 2.0001]
    assert close(ADVANTAGES.get("grpo")(r, 3, scale_rewards="group"), want, 1e-5)


def test_grpo_batch_and_none_scaling():
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])  # groups [1,3] mean 2, [0,4] mean 2
    assert close(ADVANTAGES.get("grpo")(r, 2, scale_rewards="none"), [-1, 1, -2, 2])
    std = torch.tensor([1.0, 3.0, 0.0, 4.0]).std().item()  # batch std of all rewards
    assert close(ADVANTAGES.get("grpo")(r, 2, scale_rewards="batch"), [v / (std + 1e-4) for v in (-1, 1, -2, 2)], 1e-5)
    assert close(ADVANTAGES.get("dr_grpo")(r, 2), [-1, 1, -2, 2])


def test_identical_rewards_give_zero_advantage():
    assert close(ADVANTAGES.get("grpo")(torch.tensor([1.0, 1.0, 1.0]), 3), [0, 0, 0])


def test_rloo_leave_one_out():
    r = torch.tensor([1.0, 2.0, 6.0])
    # baselines: (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    assert close(ADVANTAGES.get("rloo")(r, 3), [-3, -1.5, 4.5])


def test_unscored_rewards_are_masked_not_zeroed():
    r = torch.tensor([1.0, nan, 3.0, 5.0])  # group [1, nan]: only one scored -> mean 1; group [3,5]
    adv = ADVANTAGES.get("grpo")(r, 2, scale_rewards="none")
    assert close(adv, [0.0, 0.0, -1.0, 1.0])
    assert close(ADVANTAGES.get("rloo")(torch.tensor([1.0, nan, 2.0, 4.0, 6.0, nan]), 3), [-1, 0, 1, -2, 2, 0])


def test_frac_reward_zero_std_follows_trl_nanstd():
    from alignkit.algorithms.grpo import group_stats

    # TRL (grpo_trainer.py, is_std_zero = isclose(nanstd(group), 0)): nanstd is NaN with < 2 scored rewards,
    # so an all-NaN group is not zero-std; [1, 3] has std sqrt(2). The old nan_to_num(0) gave 0.5 here.
    adv = torch.zeros(4)
    assert group_stats(torch.tensor([nan, nan, 1.0, 3.0]), adv, 2).means()["frac_reward_zero_std"] == 0.0
    # a single scored reward: NaN std, not zero; [2, 2, nan]: two scored and equal -> zero; [0, 1, 5]: not
    r = torch.tensor([nan, 4.0, nan, 2.0, 2.0, nan, 0.0, 1.0, 5.0])
    assert group_stats(r, torch.zeros(9), 3).means()["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert group_stats(torch.tensor([1.0, nan]), torch.zeros(2), 1).means()["frac_reward_zero_std"] == 1.0


def test_gae_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # deltas: d2 = 1 - 0.5 = 0.5; d1 = 0 + 0.5 - 0.25 = 0.25; d0 = 0 + 0.25 - 0.5 = -0.25
    # A2 = 0.5; A1 = 0.25 + 0.5*0.5 = 0.5; A0 = -0.25 + 0.5*0.5 = 0
    assert close(adv, [[0.0, 0.5, 0.5]])
    assert close(ret, [[0.5, 0.75, 1.0]])


def test_whiten_uses_given_statistics():
    assert close(whiten(torch.tensor([1.0, 3.0]), 2.0, 1.0), [-1.0, 1.0], 1e-6)


# ---------------------------------------------------------------- losses
def test_clipped_surrogate_token_level():
    logps = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, clipped = clipped_surrogate(logps, old, adv, eps_low=0.2, eps_high=0.2)
    # ratios 1.5, 0.5, 1.1: -min(1.5, 1.2) = -1.2 (clipped); -min(-0.5, -0.8) = 0.8 (clipped); -1.1
    assert close(loss, [-1.2, 0.8, -1.1])
    assert close(clipped, [1.0, 1.0, 0.0])
    loss, _ = clipped_surrogate(logps, old, adv, eps_low=0.2, eps_high=0.6)  # clip-higher lets 1.5 through
    assert close(loss, [-1.5, 0.8, -1.1])


def test_clipped_surrogate_sequence_level_and_gradient():
    logps = torch.tensor([0.2, 0.4, -0.1], requires_grad=True)
    seq = torch.tensor([0, 0, 1])
    loss, _ = clipped_surrogate(logps, torch.zeros(3), torch.ones(3), eps_low=10, eps_high=10, seq=seq, num_seqs=2,
                                level="sequence")
    # sequence 0 ratio exp(mean(0.2, 0.4)) = exp(0.3); sequence 1 exp(-0.1)
    assert close(loss, [-math.exp(0.3), -math.exp(0.3), -math.exp(-0.1)])
    loss.sum().backward()
    assert close(logps.grad, [-math.exp(0.3), -math.exp(0.3), -math.exp(-0.1)])


def test_sampler_is_weights_truncate_and_mask():
    old = torch.log(torch.tensor([0.5, 0.9, 0.2, 0.6]))
    sampler = torch.log(torch.tensor([0.5, 0.3, 0.4, 0.1]))  # ratios 1, 3, 0.5, 6
    assert close(sampler_is_weights(old, sampler, cap=2.0), [1.0, 2.0, 0.5, 2.0])  # TIS: min(ratio, cap)
    assert close(sampler_is_weights(old, sampler, cap=2.0, mode="token_mask"), [1.0, 0.0, 0.5, 0.0])
    seq = torch.tensor([0, 0, 1, 1])  # sequence ratios 1 x 3 = 3 and 0.5 x 6 = 3
    assert close(sampler_is_weights(old, sampler, cap=4.0, mode="sequence_truncate", seq=seq, num_seqs=2), [3.0] * 4)
    assert close(sampler_is_weights(old, sampler, cap=2.5, mode="sequence_truncate", seq=seq, num_seqs=2), [2.5] * 4)
    assert close(sampler_is_weights(old, sampler, cap=2.5, mode="sequence_mask", seq=seq, num_seqs=2), [0.0] * 4)
    same = sampler_is_weights(old.requires_grad_(), old.detach(), cap=2.0)
    assert close(same, [1.0] * 4) and not same.requires_grad  # equal samplers: weight 1, and no gradient
    with pytest.raises(ValueError, match="sequence-level"):
        sampler_is_weights(old, sampler, cap=2.0, mode="sequence_mask")
    with pytest.raises(ValueError, match="token_truncate"):
        sampler_is_weights(old, sampler, cap=2.0, mode="tokens")


def test_clipped_value_loss():
    v = torch.tensor([1.0, 0.0])
    old = torch.tensor([0.0, 0.0])
    ret = torch.tensor([0.0, 1.0])
    # token 0: plain 1, clipped V = 0.2 -> 0.04; max = 1 -> 0.5. token 1: plain 1, clipped 0 -> 1 -> 0.5
    assert close(clipped_value_loss(v, old, ret, clip=0.2), [0.5, 0.5])
    v = torch.tensor([0.5])
    # plain (0.5-1)^2 = 0.25; clipped V = 0.2 -> 0.64; max 0.64 -> 0.32
    assert close(clipped_value_loss(v, torch.zeros(1), torch.ones(1), clip=0.2), [0.32])
    assert close(clipped_value_loss(v, torch.zeros(1), torch.ones(1), clip=0.0), [0.125])


def test_aggregations():
    per_token = torch.tensor([1.0, 2.0, 3.0, 6.0])
    seq = torch.tensor([0, 0, 0, 1])
    assert close(aggregate(per_token, seq, 2, mode="token_mean", normalizer=4), 3.0)
    assert close(aggregate(per_token, seq, 2, mode="sequence_mean", normalizer=2), (2.0 + 6.0) / 2)
    assert close(aggregate(per_token, seq, 2, mode="constant", normalizer=2 * 8), 12 / 16)
    with pytest.raises(ValueError):
        aggregate(per_token, seq, 2, mode="mean", normalizer=1)


# ---------------------------------------------------------------- rewards
def test_exact_match_and_masking():
    out = REWARD_FUNCTIONS.get("exact_match")(["q"] * 3, [" 7 ", "8", "x"], answer=[7, "7", None])
    assert out == [1.0, 0.0, None]



def test_shapes_correct_judges_the_last_question_about_the_scene():
    scene = [{"shape": "circle", "colour": "red", "position": "top left"},
             {"shape": "square", "colour": "blue", "position": "bottom right"}]
    chat = [{"role": "user", "content": "<image>\nHow many shapes are there?"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "What colour is the square?"}]
    fn = REWARD_FUNCTIONS.get("shapes_correct")
    got = fn([chat, chat, chat, [{"role": "user", "content": "Hello?"}], "What shape is in the top left?"],
             ["blue<|im_end|>", "2", "red", "blue", "Circle."], scene=[scene, scene, None, scene, scene])
    assert got == [1.0, 0.0, None, None, 1.0]

def test_combine_weights_and_none():
    per = {"a": [1.0, nan, nan], "b": [2.0, 4.0, nan]}
    out = combine(per, {"a": 1.0, "b": 0.5})
    assert out[:2] == [2.0, 2.0] and math.isnan(out[2])


def test_reward_function_errors_name_the_function():
    def bad_len(prompts, completions, **_):
        return [1.0]

    def raises(prompts, completions, **_):
        raise RuntimeError("boom")

    with pytest.raises(RewardFunctionError, match="'mine' returned 1 values for 2 completions"):
        call(WeightedFunction("mine", 1.0, bad_len), ["p", "p"], ["a", "b"], {})
    with pytest.raises(RewardFunctionError, match="'oops' raised RuntimeError: boom"):
        call(WeightedFunction("oops", 1.0, raises), ["p"], ["a"], {})
    with pytest.raises(RewardFunctionError, match="returned 'x'"):
        call(WeightedFunction("s", 1.0, lambda p, c, **_: ["x"]), ["p"], ["a"], {})


def test_ppo_kl_metric_counts_the_trained_tokens_only():
    """Issue 48: ppo_agent's logged kl is over the policy's ids (``loss_mask`` 1), not the environment's:
    (0.1 + 0.3 + 0.4) / 3, the env ids' 5.0 and 7.0 and a masked trajectory's 9.0 left out (over all: 22.8 / 6)."""
    from alignkit.algorithms.ppo import masked_token_mean

    samples = [{"kl": [0.1, 5.0, 0.3], "loss_mask": [1.0, 0.0, 1.0]},
               {"kl": [0.4, 7.0], "loss_mask": [1.0, 0.0]},
               {"kl": [9.0], "loss_mask": [0.0]}]
    assert masked_token_mean(samples, "kl") == pytest.approx(0.8 / 3, abs=1e-12)
    assert masked_token_mean([{"kl": [3.0], "loss_mask": [0.0]}], "kl") == 0.0
