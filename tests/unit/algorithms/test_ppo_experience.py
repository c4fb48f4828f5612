"""PPO / PPO-Lag experience and loss on hand-made rollouts (issue 24), and GRPO's unscorable samples.

The critics' values and the log-probs are stubbed (old = reference, so KL = 0 and the token rewards are
the sequence score at the last token alone); ``make_experience`` and ``loss`` are the real code.

* An unscorable completion (NaN score) gets advantage 0, is left out of the whitening statistics, and
  its tokens give no gradient to the policy or the critics nor count in the loss normaliser (``units``).
* PPO-Lag combines the RAW GAE advantages, A = (A_r - lambda A_c) / (1 + lambda), then whitens A once
  (ALGORITHMS 1.3), so reward and cost weigh exactly 1 : lambda.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from alignkit.algorithms import ALGORITHMS
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig

nan = math.nan


def make(name: str, *overrides: str):
    raw = {"algorithm": name, "model": {"name_or_path": "unused"}, "data": {"train": "x.jsonl"},
           "training": {"per_device_batch_size": 2}}
    cfg = build_dataclass(RunConfig, apply_overrides(raw, ["ppo_lag.cost_functions=[{name: length}]", *overrides]))
    return ALGORITHMS.get(name)(cfg, SimpleNamespace(pad_token_id=0))


def experience(algo, rewards, values, costs=None, cost_values=None):
    """Samples of ``len(v)`` completion tokens each, filled by the algorithm's ``make_experience``."""
    lens = [len(v) for v in values]
    samples = [{"prompt_ids": [1, 2], "completion_ids": [5 + i] * n} for i, n in enumerate(lens)]
    algo.tokens.logps = lambda ctx, batches, role="policy": [[-1.0] * n for n in lens]  # old = reference: KL 0
    algo._values = lambda ctx, role, batches: values if role == "value" else cost_values
    scores = {"reward": torch.tensor(rewards, dtype=torch.float64)}
    if costs is not None:
        scores["cost"] = torch.tensor(costs, dtype=torch.float64)
    stats = algo.make_experience(SimpleNamespace(mine=slice(0, len(lens))), samples, [], scores)
    return samples, stats


class FakeModels:
    """Leaf tensors as the policy's log-probs and the critics' values, so their gradients can be read."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.lp = (torch.randn(n, generator=g) * 0.1 - 1.0).requires_grad_()
        self.v = {r: torch.randn(n, generator=g).requires_grad_() for r in ("value", "cost_value")}

    def logps(self, role, batch, *, temperature=1.0, with_entropy=False):
        return (self.lp, torch.zeros_like(self.lp)) if with_entropy else self.lp

    def values(self, role, batch):
        return self.v[role]


def grads(algo, samples):
    """Per-token gradients (policy, value, cost_value) of the summed loss, split per sample."""
    batch = algo.collate(samples)
    lens = [len(s["completion_ids"]) for s in samples]
    fm = FakeModels(sum(lens))
    losses, _ = algo.loss(fm, batch, normalizer=float(algo.units(batch)))
    sum(losses.values()).backward()
    split = lambda t: [c.tolist() for c in torch.split(t, lens)] if t is not None else None  # noqa: E731
    return batch, losses, {"policy": split(fm.lp.grad), "value": split(fm.v["value"].grad),
                           "cost_value": split(fm.v["cost_value"].grad)}


# ---------------------------------------------------------------- 1. unscorable samples
def test_ppo_unscorable_sample_is_out_of_whitening_and_gets_no_gradient():
    algo = make("ppo", "ppo.lam=0.5")
    values = [[0.5, 1.0], [0.0, 0.0, 0.25], [0.3, 0.7, 0.1]]
    samples, _ = experience(algo, [2.0, -1.0, nan], values)
    assert samples[2]["advantages"] == [0.0, 0.0, 0.0]  # exactly 0 after whitening
    assert samples[2]["returns"] == values[2]
    assert [s["loss_mask"] for s in samples] == [[1.0] * 2, [1.0] * 3, [0.0] * 3]
    scored = torch.tensor(samples[0]["advantages"] + samples[1]["advantages"], dtype=torch.float64)
    assert abs(float(scored.mean())) < 1e-9  # mean 0 / var 1 over the scorable tokens only
    assert abs(float(scored.var(unbiased=False)) - 1) < 1e-6
    batch, losses, g = grads(algo, samples)
    assert algo.units(batch) == 5  # the normaliser counts the trained tokens only
    assert set(losses) == {"policy", "value"}
    for role in ("policy", "value"):
        assert g[role][2] == [0.0, 0.0, 0.0], role  # the unscorable sample: no gradient
        assert any(x != 0 for s in g[role][:2] for x in s), role


def test_ppo_lag_sample_without_a_cost_is_unscorable():
    algo = make("ppo_lag", "ppo.lam=0.5")
    values = [[0.5, 1.0], [0.0, 0.0], [0.2, 0.4]]
    samples, stats = experience(algo, [2.0, -1.0, 3.0], values, costs=[1.0, 3.0, nan],
                                cost_values=[[0.0, 0.0], [1.0, 0.0], [0.1, 0.1]])
    assert samples[2]["loss_mask"] == [0.0, 0.0] and samples[2]["advantages"] == [0.0, 0.0]
    assert samples[2]["cost_advantages"] == [0.0, 0.0] and samples[2]["returns"] == values[2]
    scored = torch.tensor(samples[0]["advantages"] + samples[1]["advantages"], dtype=torch.float64)
    assert abs(float(scored.mean())) < 1e-9 and abs(float(scored.var(unbiased=False)) - 1) < 1e-6
    _, losses, g = grads(algo, samples)
    assert set(losses) == {"policy", "value", "cost_value"}
    for role in ("policy", "value", "cost_value"):
        assert g[role][2] == [0.0, 0.0], role
    # the reward's raw advantage std over the 4 scorable tokens: [1, 1, -0.5, -1] -> var 51/64
    assert math.isclose(stats.means()["reward_advantage_std_raw"], math.sqrt(51 / 64), rel_tol=1e-9)


# ---------------------------------------------------------------- 3. PPO-Lag: combine, then whiten
# gamma 1, GAE lam 0.5, KL 0. Reward: V = [0.5, 1], R = 2 -> d = [0.5, 1], A_r = [0.5 + 0.5, 1] = [1, 1];
# V = [0, 0], R = -1 -> A_r = [-0.5, -1]. Cost: V = [0, 0], C = 1 -> A_c = [0.5, 1]; V = [1, 0], C = 3 ->
# d = [-1, 3], A_c = [-1 + 1.5, 3] = [0.5, 3].
HAND = dict(rewards=[2.0, -1.0], values=[[0.5, 1.0], [0.0, 0.0]], costs=[1.0, 3.0],
            cost_values=[[0.0, 0.0], [1.0, 0.0]])


def test_ppo_lag_whitens_the_combined_advantage_hand_values():
    samples, _ = experience(make("ppo_lag", "ppo.lam=0.5"), **HAND)  # lambda = 1
    got = samples[0]["advantages"] + samples[1]["advantages"]
    # A = (A_r - A_c) / 2 = [1/4, 0, -1/2, -2]: mean -9/16, var 195/256 -> [13, 9, 1, -23] / sqrt(195)
    new = [v / math.sqrt(195) for v in (13, 9, 1, -23)]
    # the old order: whiten A_r ([7, 7, -5, -9] / sqrt(51)) and A_c ([-3, -1, -3, 7] / sqrt(17)) apart
    old = [(r / math.sqrt(51) - c / math.sqrt(17)) / 2 for r, c in zip((7, 7, -5, -9), (-3, -1, -3, 7))]
    assert max(abs(a - b) for a, b in zip(got, old)) > 0.1  # 0.931 vs 0.854 on the first token
    assert got == pytest.approx(new, abs=1e-7)
    # the raw GAE advantages stay as computed (the cost's unwhitened)
    assert samples[0]["reward_advantages"] + samples[1]["reward_advantages"] == [1.0, 1.0, -0.5, -1.0]
    assert samples[0]["cost_advantages"] + samples[1]["cost_advantages"] == [0.5, 1.0, 0.5, 3.0]


@pytest.mark.parametrize("lam", [1.0, 2.5])
def test_ppo_lag_reward_and_cost_weigh_one_to_lambda(lam: float):
    raw = make("ppo_lag", "ppo.lam=0.5", "ppo.whiten_advantages=false", f"ppo_lag.lambda_init={lam}")
    samples, _ = experience(raw, **HAND)
    a_r, a_c = [1.0, 1.0, -0.5, -1.0], [0.5, 1.0, 0.5, 3.0]
    combined = [(r - lam * c) / (1 + lam) for r, c in zip(a_r, a_c)]
    assert samples[0]["advantages"] + samples[1]["advantages"] == pytest.approx(combined, abs=1e-12)
    # whitened: ONE affine map of A_r - lambda A_c for every token (the 1 : lambda weighting is kept)
    samples, _ = experience(make("ppo_lag", "ppo.lam=0.5", f"ppo_lag.lambda_init={lam}"), **HAND)
    w = samples[0]["advantages"] + samples[1]["advantages"]
    scale = (w[0] - w[3]) / (combined[0] - combined[3])
    assert [w[i] - scale * combined[i] for i in range(4)] == pytest.approx([w[0] - scale * combined[0]] * 4, abs=1e-9)


# ---------------------------------------------------------------- GRPO: already right (no change)
def test_grpo_unscorable_sample_has_zero_advantage_and_no_gradient():
    algo = make("grpo", "rollout.num_generations=2")
    samples, _ = experience(algo, [1.0, nan, 3.0, 5.0], [[0.0] * 2, [0.0] * 3, [0.0] * 2, [0.0] * 2])
    assert [s["advantages"][0] for s in samples[:2]] == [0.0, 0.0]
    assert samples[2]["advantages"][0] < 0 < samples[3]["advantages"][0]
    batch = algo.collate(samples)
    fm = FakeModels(9)
    loss, _ = algo.loss(fm, batch, normalizer=4.0)
    loss.backward()
    per = [c.tolist() for c in torch.split(fm.lp.grad, [2, 3, 2, 2])]
    assert per[1] == [0.0, 0.0, 0.0] and all(x != 0 for s in per[2:] for x in s)


# ---------------------------------------------------------------- 7. mask_truncated_completions
@pytest.mark.parametrize("mask", [True, False])
def test_truncated_completions_carry_no_loss_when_masked(mask: bool):
    """TRL's ``mask_truncated_completions``: a completion cut by max_new_tokens keeps its place in the group's
    reward statistics but its tokens get no gradient and leave the token-mean normaliser; off (the default)
    they train as before."""
    algo = make("grpo", "rollout.num_generations=2", "grpo.loss_aggregation=token_mean",
                f"rollout.mask_truncated_completions={str(mask).lower()}")
    lens = [2, 3, 2, 2]
    samples = [{"prompt_ids": [1, 2], "completion_ids": [5 + i] * n} for i, n in enumerate(lens)]
    algo.tokens.mask_truncated(samples, [False, True, False, False])
    algo.tokens.logps = lambda ctx, batches, role="policy": [[-1.0] * n for n in lens]
    algo.make_experience(SimpleNamespace(mine=slice(0, 4)), samples, [], {"reward": torch.tensor([1.0, 3.0, 2.0, 5.0])})
    assert samples[1]["advantages"][0] > 0  # still scored and in its group
    batch = algo.collate(samples)
    assert algo.units(batch) == (6 if mask else 9)
    fm = FakeModels(9)
    loss, m = algo.loss(fm, batch, normalizer=float(algo.units(batch)))
    loss.backward()
    truncated = torch.split(fm.lp.grad, lens)[1]
    assert (truncated == 0).all() if mask else (truncated != 0).all()
    assert float(m.counts["clip_fraction"]) == float(m.counts["entropy"]) == (6 if mask else 9)  # metrics too


def test_ppo_metrics_leave_out_unscorable_tokens():
    """clip_fraction, entropy and the value losses average the trained tokens only, as the loss does."""
    algo = make("ppo_lag", "ppo.lam=0.5")
    values = [[0.5, 1.0], [0.0, 0.0, 0.25], [0.3, 0.7, 0.1]]
    samples, _ = experience(algo, [2.0, -1.0, nan], values, costs=[1.0, 0.0, 2.0], cost_values=values)
    batch = algo.collate(samples)
    fm = FakeModels(8)
    fm.logps = lambda role, batch, *, temperature=1.0, with_entropy=False: (fm.lp, torch.arange(8.0))
    _, m = algo.loss(fm, batch, normalizer=float(algo.units(batch)))
    means = m.means()
    assert float(m.counts["entropy"]) == 5 and means["entropy"] == pytest.approx(sum(range(5)) / 5)
    for name in ("clip_fraction", "value_loss", "cost_value_loss"):
        assert float(m.counts[name]) == 5, name
