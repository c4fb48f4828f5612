"""losses: hand-computed values (arithmetic in the comments), gradients and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses import (
    DPO_LOSSES,
    KL_ESTIMATORS,
    bradley_terry_loss,
    cost_model_loss,
    dpo_loss,
    dynamic_beta,
    kl_estimate,
    lagrange_update,
    safe_dpo_loss,
    sft_loss,
)

T = torch.tensor


def approx(x, rel=1e-6):
    return pytest.approx(x, rel=rel, abs=1e-7)


# ---------------------------------------------------------------- sft


def test_sft_loss_sum_over_normalizer():
    # -(-1 - 2 - 3) / 2 = 3
    assert sft_loss(T([-1.0, -2.0, -3.0]), normalizer=2.0).item() == 3.0
    with pytest.raises(ValueError, match="normalizer"):
        sft_loss(T([-1.0]), normalizer=0)


def test_sft_loss_micro_batches_sum_to_full_batch():
    # ALGORITHMS 6.1: with one global normaliser the micro-batch losses add up to the full-batch loss
    logps = torch.randn(10)
    full = sft_loss(logps, normalizer=10.0)
    parts = sft_loss(logps[:3], normalizer=10.0) + sft_loss(logps[3:], normalizer=10.0)
    torch.testing.assert_close(parts, full)


# ---------------------------------------------------------------- dpo family

# policy_c=-1, policy_r=-3, ref_c=ref_r=-2  ->  ratio_c = 1, ratio_r = -1, h = 2
PC, PR, RC, RR = T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0])


def test_dpo_sigmoid_hand_value_and_metrics():
    # beta=0.1, h=2 -> loss = -log sigma(0.2) = log(1 + e^-0.2) = log(1.8187308) = 0.5981389
    losses, m = dpo_loss(PC, PR, RC, RR, beta=0.1)
    assert losses.item() == approx(math.log1p(math.exp(-0.2)))
    assert losses.item() == approx(0.598138869)
    assert m["rewards/chosen"].item() == approx(0.1)  # 0.1 * (-1 - -2)
    assert m["rewards/rejected"].item() == approx(-0.1)  # 0.1 * (-3 - -2)
    assert m["rewards/margin"].item() == approx(0.2)
    assert m["rewards/accuracy"].item() == 1.0


def test_dpo_sigmoid_gradient():
    # d/dpc [-log sigma(beta*h)] = -beta * sigma(-beta*h) = -0.1 * sigma(-0.2) = -0.1 * 0.4501660 = -0.0450166
    pc = PC.clone().requires_grad_()
    losses, m = dpo_loss(pc, PR, RC, RR, beta=0.1)
    losses.sum().backward()
    assert pc.grad.item() == approx(-0.1 / (1 + math.exp(0.2)))
    assert not m["rewards/chosen"].requires_grad


def test_cdpo_label_smoothing_hand_value():
    # eps=0.1: 0.9*log(1+e^-0.2) + 0.1*log(1+e^0.2); log(1+e^0.2) = 0.2 + log(1+e^-0.2)
    #        = log(1+e^-0.2) + 0.1*0.2 = 0.5981389 + 0.02 = 0.6181389
    losses, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    assert losses.item() == approx(0.618138869)


def test_label_smoothing_zero_equals_plain_sigmoid():
    pc, pr, rc, rr = (torch.randn(6) for _ in range(4))
    a, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)
    b, _ = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dpo_sigmoid_stable_for_large_margins():
    losses, _ = dpo_loss(T([0.0]), T([-1e4]), T([0.0]), T([0.0]), beta=1.0)
    assert losses.item() == 0.0  # log(1 + e^-10000) underflows to 0, not nan
    losses, _ = dpo_loss(T([-1e4]), T([0.0]), T([0.0]), T([0.0]), beta=1.0)
    assert losses.item() == approx(1e4)


def test_ipo_equal_logps_is_inverse_two_beta_squared():
    # h = 0 -> (0 - 1/(2*0.1))^2 = 5^2 = 25
    x = T([-4.0, -7.0])
    losses, m = dpo_loss(x, x, x, x, loss_type="ipo", beta=0.1)
    torch.testing.assert_close(losses, T([25.0, 25.0]))
    assert m["rewards/accuracy"].tolist() == [0.0, 0.0]  # a tie is not a win


def test_ipo_length_normalised_hand_value():
    # chosen ratio (-4 - -6)/2 = 1, rejected ratio (-9 - -6)/3 = -1, h = 2; beta=0.5 -> 1/(2*0.5) = 1
    # loss = (2 - 1)^2 = 1; rewards = 0.5*1 = 0.5 and 0.5*-1 = -0.5
    losses, m = dpo_loss(T([-4.0]), T([-9.0]), T([-6.0]), T([-6.0]), loss_type="ipo", beta=0.5,
                         chosen_lengths=T([2]), rejected_lengths=T([3]))
    assert losses.item() == approx(1.0)
    assert m["rewards/chosen"].item() == approx(0.5) and m["rewards/rejected"].item() == approx(-0.5)
    # without lengths: h = 2 - (-3) = 5 -> (5 - 1)^2 = 16
    losses, _ = dpo_loss(T([-4.0]), T([-9.0]), T([-6.0]), T([-6.0]), loss_type="ipo", beta=0.5)
    assert losses.item() == approx(16.0)


def test_simpo_without_reference_hand_value():
    # beta=2, gamma=0.5: chosen 2*(-6/3) = -4, rejected 2*(-12/4) = -6, z = -4 + 6 - 0.5 = 1.5
    # loss = log(1 + e^-1.5) = log(1.2231302) = 0.2014133
    losses, m = dpo_loss(T([-6.0]), T([-12.0]), None, None, loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                         chosen_lengths=T([3]), rejected_lengths=T([4]))
    assert losses.item() == approx(0.201413277)
    assert m["rewards/chosen"].item() == approx(-4.0) and m["rewards/rejected"].item() == approx(-6.0)
    assert m["rewards/margin"].item() == approx(2.0)


def test_per_sample_beta_tensor():
    # h = 2 for both pairs; beta = [0.1, 0.2] -> log(1+e^-0.2) = 0.5981389, log(1+e^-0.4) = 0.5130153
    pc, pr, rc, rr = T([-1.0, -1.0]), T([-3.0, -3.0]), T([-2.0, -2.0]), T([-2.0, -2.0])
    losses, m = dpo_loss(pc, pr, rc, rr, beta=T([0.1, 0.2]))
    torch.testing.assert_close(losses, T([0.598138869, 0.513015309]))
    torch.testing.assert_close(m["rewards/chosen"], T([0.1, 0.2]))
    # works for ipo too: 1/(2*[0.1, 0.5]) = [5, 1]; h = 2 -> [(2-5)^2, (2-1)^2] = [9, 1]
    losses, _ = dpo_loss(pc, pr, rc, rr, loss_type="ipo", beta=T([0.1, 0.5]))
    torch.testing.assert_close(losses, T([9.0, 1.0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_type="sigmoid", ref=False), "ref_chosen_logps"),
        (dict(loss_type="ipo", ref=False), "ref_chosen_logps"),
        (dict(loss_type="simpo"), "chosen_lengths"),
        (dict(loss_type="ipo", chosen_lengths=T([2])), "both"),
        (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
        (dict(label_smoothing=0.7), "label_smoothing"),
        (dict(beta=0.0), "beta"),
        (dict(beta=T([0.1, 0.1, 0.1])), "per-pair beta"),
    ],
)
def test_dpo_wrong_combinations_raise(kwargs, match):
    ref = kwargs.pop("ref", True)
    with pytest.raises(ValueError, match=match):
        dpo_loss(PC, PR, RC if ref else None, RR if ref else None, **kwargs)


def test_dpo_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(T([-1.0, -2.0]), PR, RC, RR)


def test_unknown_loss_type_names_the_choices():
    with pytest.raises(KeyError) as err:
        dpo_loss(PC, PR, RC, RR, loss_type="sigmoidd")
    msg = str(err.value)
    assert "'sigmoid'" in msg and "ipo" in msg and "simpo" in msg
    assert DPO_LOSSES.names() == ["ipo", "sigmoid", "simpo"]


# ---------------------------------------------------------------- safe-mm-dpo


def test_dynamic_beta_hand_value_and_bounds():
    # delta = +-2, k=0.5, w=0.5: 0.1*(1 + 0.5*(1 - e^-1)) = 0.1*(1 + 0.5*0.6321206) = 0.1316060
    delta = T([0.0, 2.0, -2.0, 1e6], requires_grad=True)
    beta = dynamic_beta(delta, beta_base=0.1, w=0.5, k=0.5)
    torch.testing.assert_close(beta, T([0.1, 0.131606028, 0.131606028, 0.15]))
    assert not beta.requires_grad
    assert torch.all(beta >= 0.1) and torch.all(beta <= 0.15 + 1e-9)
    with pytest.raises(ValueError):
        dynamic_beta(delta, beta_base=0.0)


def test_dynamic_beta_feeds_dpo():
    beta = dynamic_beta(T([2.0]))
    losses, _ = dpo_loss(PC, PR, RC, RR, beta=beta)
    # beta = 0.1316060, h = 2 -> log(1 + e^-0.2632121)
    assert losses.item() == approx(math.log1p(math.exp(-2 * 0.131606028)))


def test_safe_dpo_loss_mix():
    # (1 + 1*3)/(1 + 1) = 2; lambda=0 -> loss_h; lambda=3 -> (1 + 9)/4 = 2.5
    lh, ls = T([1.0]), T([3.0])
    assert safe_dpo_loss(lh, ls, 1.0).item() == 2.0
    assert safe_dpo_loss(lh, ls, 0.0).item() == 1.0
    assert safe_dpo_loss(lh, ls, 3.0).item() == 2.5
    with pytest.raises(ValueError):
        safe_dpo_loss(lh, ls, -1.0)


def test_lagrange_update_direction_and_cap():
    # log_lam=0 (lam=1), lr=0.1: J_c=0.5 > thr=0 -> 0 + 0.1*1*0.5 = 0.05 (lambda grows)
    assert lagrange_update(0.0, 0.5, threshold=0.0, lr=0.1, lam_max=10.0) == approx(0.05)
    # J_c=-0.5 < thr -> -0.05 (lambda shrinks, stays > 0 in log space)
    assert lagrange_update(0.0, -0.5, threshold=0.0, lr=0.1, lam_max=10.0) == approx(-0.05)
    # step scales with lambda: log_lam=log 2 -> log 2 + 0.1*2*0.5 = 0.6931472 + 0.1
    assert lagrange_update(math.log(2), 0.5, threshold=0.0, lr=0.1, lam_max=10.0) == approx(math.log(2) + 0.1)
    # threshold shifts the target: J_c=0.5, thr=0.5 -> no move
    assert lagrange_update(0.3, 0.5, threshold=0.5, lr=0.1, lam_max=10.0) == 0.3
    # cap: lam_max=1 -> min(0.05, log 1 = 0) = 0
    assert lagrange_update(0.0, 0.5, threshold=0.0, lr=0.1, lam_max=1.0) == 0.0
    assert isinstance(lagrange_update(0.0, 0.5, threshold=0.0, lr=0.1, lam_max=1.0), float)


# ---------------------------------------------------------------- reward / cost models


def test_bradley_terry_hand_values():
    rc, rr = T([2.0]), T([1.0])
    # -log sigma(1) = log(1 + e^-1) = 0.3132617
    losses, m = bradley_terry_loss(rc, rr)
    assert losses.item() == approx(0.313261687)
    assert m["accuracy"].item() == 1.0 and m["margin"].item() == 1.0
    assert m["chosen"].item() == 2.0 and m["rejected"].item() == 1.0
    # margin m=1: -log sigma(0) = log 2 = 0.6931472
    assert bradley_terry_loss(rc, rr, margin=T([1.0]))[0].item() == approx(math.log(2))
    # center: + 0.01*(2+1)^2 = 0.09 -> 0.4032617
    assert bradley_terry_loss(rc, rr, center_coeff=0.01)[0].item() == approx(0.403261687)
    # reg: + 0.1*(4+1)/2 = 0.25 -> 0.5632617
    assert bradley_terry_loss(rc, rr, reg_coeff=0.1)[0].item() == approx(0.563261687)


def test_bradley_terry_gradient_and_stability():
    rc = T([2.0], requires_grad=True)
    losses, m = bradley_terry_loss(rc, T([1.0]))
    losses.sum().backward()
    # d/drc = -sigma(-1) = -0.2689414
    assert rc.grad.item() == approx(-1 / (1 + math.e))
    assert not m["chosen"].requires_grad
    assert bradley_terry_loss(T([-1e4]), T([0.0]))[0].item() == approx(1e4)


def test_cost_model_hand_values_and_sign_terms():
    # C_h=1 (unsafe, s=+1), C_s=-1 (safe, s=-1):
    #   -log sigma(2) - log sigma(1) - log sigma(1) = 0.1269280 + 2*0.3132617 = 0.7534514
    losses, m = cost_model_loss(T([1.0]), T([-1.0]), T([True]), T([False]))
    assert losses.item() == approx(0.753451386)
    assert m["accuracy"].item() == 1.0 and m["sign_accuracy"].item() == 1.0
    # both labelled unsafe: the safer one's sign term flips to -log sigma(+1 * -1) = 1.3132617
    #   0.1269280 + 0.3132617 + 1.3132617 = 1.7534514; sign accuracy 1/2 (C_s=-1 says safe)
    losses, m = cost_model_loss(T([1.0]), T([-1.0]), T([True]), T([True]))
    assert losses.item() == approx(1.753451385)
    assert m["sign_accuracy"].item() == 0.5
    # wrong order, both signs wrong: C_h=-1 (unsafe), C_s=1 (safe) -> -log sigma(-2) + 2*(-log sigma(-1))
    #   = 2.1269280 + 2*1.3132617 = 4.7534514; accuracy 0, sign accuracy 0
    losses, m = cost_model_loss(T([-1.0]), T([1.0]), T([True]), T([False]))
    assert losses.item() == approx(4.753451385)
    assert m["accuracy"].item() == 0.0 and m["sign_accuracy"].item() == 0.0
    # reg: + 0.1*(1 + 1)/2 = 0.1
    losses, _ = cost_model_loss(T([1.0]), T([-1.0]), T([True]), T([False]), reg_coeff=0.1)
    assert losses.item() == approx(0.853451386)


def test_cost_model_sign_gradient_pushes_to_boundary_side():
    # an unsafe response with C < 0 must be pushed up (negative gradient); a safe one with C > 0 down
    c_h = T([-0.5], requires_grad=True)
    c_s = T([0.5], requires_grad=True)
    losses, _ = cost_model_loss(c_h, c_s, T([True]), T([False]))
    losses.sum().backward()
    assert c_h.grad.item() < 0 and c_s.grad.item() > 0


def test_cost_model_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        cost_model_loss(T([1.0, 2.0]), T([0.0]), T([True]), T([False]))


# ---------------------------------------------------------------- kl


def test_kl_estimators_hand_values():
    # L = logp - ref = -1.0 - -1.5 = 0.5
    # k1 = 0.5; k2 = 0.5^2/2 = 0.125; k3 = e^-0.5 - 1 + 0.5 = 0.6065307 - 0.5 = 0.1065307
    logps, ref = T([-1.0]), T([-1.5])
    assert kl_estimate(logps, ref).item() == approx(0.5)
    assert kl_estimate(logps, ref, kind="k2").item() == approx(0.125)
    assert kl_estimate(logps, ref, kind="k3").item() == approx(0.106530660)
    # k1 can be negative; k3 never is (L=-0.5: e^0.5 - 1 - 0.5 = 0.1487213)
    assert kl_estimate(ref, logps).item() == approx(-0.5)
    assert kl_estimate(ref, logps, kind="k3").item() == approx(0.148721271)


def test_kl_elementwise_shape_and_zero_at_equality():
    x = torch.randn(2, 5)
    for kind in KL_ESTIMATORS.names():
        out = kl_estimate(x, x, kind=kind)
        assert out.shape == (2, 5)
        assert torch.all(out == 0)


def test_kl_unknown_kind_names_the_choices():
    with pytest.raises(KeyError, match=r"k1.*k2.*k3"):
        kl_estimate(T([0.0]), T([0.0]), kind="k4")
