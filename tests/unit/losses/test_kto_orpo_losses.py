"""ORPO and KTO losses against values computed by hand (scalar math, not torch)."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses import kto_loss, kto_reference_point, orpo_loss
from alignkit.losses.orpo import log1mexp


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _log_odds(avg_logp: float) -> float:
    # log(P / (1 - P)) with P = exp(a): ORPO Eq. 4
    return avg_logp - math.log(1 - math.exp(avg_logp))


def test_orpo_loss_by_hand() -> None:
    # pair 0: chosen sum -2 over 2 tokens (a = -1), rejected -6 over 3 (a = -2)
    # pair 1: chosen -0.3 over 3 (a = -0.1, P > 1/2: the other branch of log1mexp), rejected -0.2 over 4 (a = -0.05)
    chosen, rejected = torch.tensor([-2.0, -0.3]), torch.tensor([-6.0, -0.2])
    lc, lr = torch.tensor([2.0, 3.0]), torch.tensor([3.0, 4.0])
    beta = 0.25
    losses, m = orpo_loss(chosen, rejected, lc, lr, beta=beta)
    for i, (ac, ar) in enumerate([(-1.0, -2.0), (-0.1, -0.05)]):
        z = _log_odds(ac) - _log_odds(ar)
        ratio = math.log(_sigmoid(z))
        assert losses[i].item() == pytest.approx(-ac - beta * ratio, rel=1e-6)
        assert m["log_odds_chosen"][i].item() == pytest.approx(z, rel=1e-6)
        assert m["log_odds_ratio"][i].item() == pytest.approx(ratio, rel=1e-6)
        assert m["nll"][i].item() == pytest.approx(-ac, rel=1e-6)
        assert m["rewards/chosen"][i].item() == pytest.approx(beta * ac, rel=1e-6)
        assert m["rewards/margin"][i].item() == pytest.approx(beta * (ac - ar), rel=1e-6)
    # pair 0 written out: log odds -0.5413249 vs -1.8545865, log sigma(1.3132617) = -0.2381830
    assert losses[0].item() == pytest.approx(1.0 + 0.25 * 0.2381830, abs=1e-6)
    assert not any(t.requires_grad for t in m.values())


def test_orpo_gradient_raises_chosen_lowers_rejected_and_is_finite_at_probability_one() -> None:
    chosen = torch.tensor([-4.0, 0.0], requires_grad=True)  # the second: every token has probability 1
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    losses, _ = orpo_loss(chosen, rejected, torch.tensor([2.0, 2.0]), torch.tensor([2.0, 2.0]), beta=0.1)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    assert chosen.grad[0] < 0 and rejected.grad[0] > 0  # descent raises logp(chosen), lowers logp(rejected)


def test_log1mexp_matches_the_naive_formula() -> None:
    x = torch.tensor([-30.0, -5.0, -0.7, -0.69, -1e-3], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)))


@pytest.mark.parametrize(("beta", "shapes"), [(0.0, None), (0.1, (3, 2))])
def test_orpo_loss_rejects_bad_arguments(beta: float, shapes: tuple[int, int] | None) -> None:
    n, m = shapes or (2, 2)
    with pytest.raises(ValueError, match="orpo_loss"):
        orpo_loss(torch.zeros(n) - 1, torch.zeros(m) - 1, torch.ones(n), torch.ones(n), beta=beta)


def test_kto_loss_by_hand() -> None:
    policy = torch.tensor([-3.0, -5.0, -2.0, -7.0])
    ref = torch.tensor([-4.0, -4.5, -2.5, -6.0])  # r = 1, -0.5, 0.5, -1
    desirable = torch.tensor([True, False, True, False])
    z0, beta, wd, wu = 0.2, 0.5, 1.5, 0.8
    losses, m = kto_loss(policy, ref, desirable, torch.tensor(z0), beta=beta, desirable_weight=wd, undesirable_weight=wu)
    expected = [wd * (1 - _sigmoid(beta * (1 - z0))), wu * (1 - _sigmoid(beta * (z0 + 0.5))),
                wd * (1 - _sigmoid(beta * (0.5 - z0))), wu * (1 - _sigmoid(beta * (z0 + 1)))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert m["rewards"].tolist() == pytest.approx([0.5, -0.25, 0.25, -0.5])


def test_kto_reference_point_is_a_clamped_detached_mean() -> None:
    s = torch.tensor(1.5, requires_grad=True)
    z0 = kto_reference_point(s * 1, torch.tensor(4.0))
    assert z0.item() == pytest.approx(0.375) and not z0.requires_grad
    assert kto_reference_point(torch.tensor(-2.0), torch.tensor(4.0)).item() == 0.0  # a negative estimate: 0
    assert kto_reference_point(torch.tensor(0.0), torch.tensor(0.0)).item() == 0.0  # no pairs: 0, not NaN


def test_kto_gradient_flows_through_the_policy_only() -> None:
    policy = torch.tensor([-3.0, -3.0], requires_grad=True)
    z0 = torch.tensor(0.3, requires_grad=True)
    losses, _ = kto_loss(policy, torch.tensor([-3.0, -3.0]), torch.tensor([True, False]), z0)
    losses.sum().backward()
    assert z0.grad is None
    assert policy.grad[0] < 0 and policy.grad[1] > 0  # raise the desirable, lower the undesirable
