"""Hand-computed values of the off-policy corrections (IcePop, the geometric-mean sequence mask, the decoupled
objective) and of CISPO's loss (losses/rl.py)."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses.rl import cispo_loss, clipped_surrogate, decoupled_surrogate, sampler_is_weights


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


OLD = torch.log(torch.tensor([0.5, 0.9, 0.2, 0.6, 0.3]))
BEHAV = torch.log(torch.tensor([0.5, 0.3, 0.4, 0.1, 0.4]))  # ratios 1, 3, 0.5, 6, 0.75


def test_icepop_keeps_the_ratio_inside_the_band_and_zeroes_outside():
    # band [0.6, 2]: 1 kept, 3 above, 0.5 below, 6 above, 0.75 kept
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, low=0.6, mode="icepop"), [1.0, 0.0, 0.0, 0.0, 0.75])
    # low 0: only the upper edge acts (= token_mask)
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, low=0.0, mode="icepop"), [1.0, 0.0, 0.5, 0.0, 0.75])


def test_geometric_sequence_mask():
    seq = torch.tensor([0, 0, 1, 1, 2])
    # geometric means: seq 0 sqrt(1 x 3) = 1.732, seq 1 sqrt(0.5 x 6) = 1.732, seq 2 0.75
    w = sampler_is_weights(OLD, BEHAV, cap=2.0, low=0.8, mode="sequence_geo_mask", seq=seq, num_seqs=3)
    assert close(w, [1.0, 1.0, 1.0, 1.0, 0.0])  # 0.75 < 0.8: sequence 2 masked; the others are weight 1, not r
    w = sampler_is_weights(OLD, BEHAV, cap=1.7, low=0.5, mode="sequence_geo_mask", seq=seq, num_seqs=3)
    assert close(w, [0.0, 0.0, 0.0, 0.0, 1.0])  # 1.732 > 1.7: sequences 0 and 1 masked
    with pytest.raises(ValueError, match="sequence-level"):
        sampler_is_weights(OLD, BEHAV, cap=2.0, mode="sequence_geo_mask")


def test_decoupled_objective_clips_against_the_proximal_policy_and_weights_to_the_behaviour():
    logps = torch.log(torch.tensor([0.5, 1.0, 0.2, 0.6, 0.3])).requires_grad_()  # current / proximal: 1, 1.11, 1, 1, 1
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 1.0])
    loss, clipped, w = decoupled_surrogate(logps, OLD, BEHAV, adv, eps_low=0.05, eps_high=0.05, correction="icepop",
                                           cap=2.0, low=0.6)
    assert close(w, [1.0, 0.0, 0.0, 0.0, 0.75])
    # token 0: ratio 1, -1 x w 1; token 1: ratio 10/9 clipped to 1.05 but w 0; token 4: -0.75 x 1
    assert close(loss, [-1.0, 0.0, 0.0, 0.0, -0.75])
    assert close(clipped, [0.0, 1.0, 0.0, 0.0, 0.0])
    loss.sum().backward()
    assert close(logps.grad, [-1.0, 0.0, 0.0, 0.0, -0.75])  # d(-w r A)/dlogp = -w r A at r = 1
    # with truncation (TIS) the weights are min(r, cap): the decoupled loss = TIS x the proximal-clipped surrogate
    plain, _ = clipped_surrogate(logps.detach(), OLD, adv, eps_low=0.2, eps_high=0.2)
    tis, _, _ = decoupled_surrogate(logps.detach(), OLD, BEHAV, adv, eps_low=0.2, eps_high=0.2,
                                    correction="token_truncate", cap=2.0)
    assert close(tis, plain * torch.tensor([1.0, 2.0, 0.5, 2.0, 0.75]))


def test_cispo_is_a_clipped_stop_gradient_weight_on_reinforce():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    logps = torch.log(torch.tensor([0.5, 0.9, 0.2])).requires_grad_()  # ratios 1, 1.8, 0.4
    adv = torch.tensor([2.0, 1.0, -1.0])
    loss, clipped = cispo_loss(logps, old, adv, eps_low=0.2, eps_high=0.5)  # weights 1, 1.5, 0.8
    assert close(loss, [-2.0 * math.log(0.5), -1.5 * math.log(0.9), 0.8 * math.log(0.2)])
    assert close(clipped, [0.0, 1.0, 1.0])
    loss.sum().backward()
    # the gradient is -w A on every token, the clipped ones included (PPO's clip would give 0 on token 1)
    assert close(logps.grad, [-2.0, -1.5, 0.8])


def test_overlong_soft_punishment():
    from alignkit.rewards.signals import overlong_penalty

    # max 16, buffer 4: 0 up to 12 tokens, then -f x (n - 12) / 4, -f at 16 (DAPO eq. 13)
    assert [overlong_penalty(n, 16, 4, 0.5) for n in (1, 12, 13, 14, 16, 20)] == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


# an agent's two trajectories: seq 0 = policy, ENV, policy; seq 1 = policy, ENV (the env ids are no policy draw)
AGENT_SEQ, AGENT_MASK = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])


def test_sequence_weights_sum_over_the_policy_tokens_only():
    """Issue 48: with the mask, seq 0's ratio is 1 x 0.5 = 0.5 (not 1 x 3 x 0.5 = 1.5), seq 1's is 6 (not 6 x 0.75)."""
    kw = {"seq": AGENT_SEQ, "num_seqs": 2, "mask": AGENT_MASK}
    assert close(sampler_is_weights(OLD, BEHAV, cap=float("inf"), mode="sequence_truncate", **kw),
                 [0.5, 0.5, 0.5, 6.0, 6.0])
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, mode="sequence_truncate", **kw), [0.5, 0.5, 0.5, 2.0, 2.0])
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, mode="sequence_mask", **kw), [0.5, 0.5, 0.5, 0.0, 0.0])
    # geometric mean over the policy tokens: seq 0 sqrt(0.5) = 0.707 < 0.8 masked (over all: 1.5^(1/3) = 1.14 kept)
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, low=0.8, mode="sequence_geo_mask", **kw), [0.0] * 5)
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, low=0.8, mode="sequence_geo_mask", seq=AGENT_SEQ, num_seqs=2),
                 [1.0, 1.0, 1.0, 0.0, 0.0])
    # no mask = every token (the old behaviour); a sequence with no policy token gets ratio 1
    assert close(sampler_is_weights(OLD, BEHAV, cap=float("inf"), mode="sequence_truncate", seq=AGENT_SEQ, num_seqs=2),
                 [1.5, 1.5, 1.5, 4.5, 4.5])
    none = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    assert close(sampler_is_weights(OLD, BEHAV, cap=float("inf"), mode="sequence_truncate", seq=AGENT_SEQ,
                                    num_seqs=2, mask=none)[3:], [1.0, 1.0])
    # token modes ignore the mask (each token its own ratio)
    assert close(sampler_is_weights(OLD, BEHAV, cap=2.0, mode="token_truncate", mask=AGENT_MASK),
                 [1.0, 2.0, 0.5, 2.0, 0.75])


def test_sequence_ratio_of_the_surrogate_averages_the_policy_tokens_only():
    """GSPO's sequence ratio with the mask: seq 0 exp(mean(log 1, log 0.5)) = 0.7071 (inside the 0.8 clip's
    min: unclipped), seq 1 exp(log 6) = 6 -> clipped at 1.2 (A = 1): losses -0.7071 x 3, -1.2 x 2."""
    loss, clipped = clipped_surrogate(OLD, BEHAV, torch.ones(5), eps_low=0.2, eps_high=0.2, seq=AGENT_SEQ, num_seqs=2,
                                      level="sequence", mask=AGENT_MASK)
    r0 = math.sqrt(0.5)
    assert close(loss, [-r0, -r0, -r0, -1.2, -1.2]) and clipped.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    _, w = decoupled_surrogate(OLD, OLD, BEHAV, torch.ones(5), eps_low=0.2, eps_high=0.2, correction="sequence_truncate",
                               cap=10.0, seq=AGENT_SEQ, num_seqs=2, level="sequence", mask=AGENT_MASK)[1:]
    assert close(w, [0.5, 0.5, 0.5, 6.0, 6.0])


def test_the_loss_caller_passes_the_loss_mask_to_sequence_weights():
    """``TokenRollout.sampler_weights`` (what GRPO's and PPO's losses multiply by) on a collated micro-batch of the two
    agent trajectories above (``P E P`` and ``P E``), ``off_policy.correction: sequence_truncate`` with cap 5:
    seq 0 min(1 x 0.5, 5) = 0.5, seq 1 min(6, 5) = 5 (over every id: 1.5 and 4.5); the logged ratio before the cap
    is the kept tokens' mean (0.5 + 0.5 + 6) / 3."""
    import alignkit.algorithms  # noqa: F401  (registers the sections)
    from alignkit.algorithms.token_rollout import TokenRollout
    from alignkit.config import load_config
    from alignkit.metrics import MetricSums
    from alignkit.rollout.experience import collate_samples, flat

    cfg = load_config(None, ["algorithm=grpo_agent", "model.name_or_path=none", "training.per_device_batch_size=2",
                             "data.train=builtin:calculator_prompts_train.jsonl", "off_policy.correction=sequence_truncate",
                             "off_policy.cap=5.0", "off_policy.low=0.1"])
    old, behav, mask = OLD.tolist(), BEHAV.tolist(), AGENT_MASK.tolist()
    samples = [{"prompt_ids": [7], "completion_ids": [1, 2, 3], "old_logps": old[:3], "sampler_logps": behav[:3],
                "loss_mask": mask[:3]},
               {"prompt_ids": [7], "completion_ids": [4, 5], "old_logps": old[3:], "sampler_logps": behav[3:],
                "loss_mask": mask[3:]}]
    batch = collate_samples(samples, 0)
    m = MetricSums()
    w = TokenRollout(cfg).sampler_weights(batch, flat(batch, "old_logps"), flat(batch, "loss_mask"), m)
    assert close(w, [0.5, 0.5, 0.5, 5.0, 5.0])
    assert m.means()["sampler_is_ratio"] == pytest.approx(7.0 / 3, abs=1e-5)
