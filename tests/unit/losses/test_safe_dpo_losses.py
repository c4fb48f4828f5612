"""Safe-MM-DPO and its variants per row, against values worked out by hand (ALGORITHMS 1.4-1.6)."""

from __future__ import annotations

import math

import pytest
import torch
from pytest import approx

from alignkit.losses.safe_dpo import SAFE_DPO_VARIANTS, SafeParams, SafeRows, lagrange_update, ordered, safe_rows_loss


def T(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def softplus(x: float) -> float:  # -log sigma(-x)
    return math.log1p(math.exp(x))


def rows(**over: torch.Tensor) -> SafeRows:
    # log-ratios: y_0 +0.5, y_1 -0.5 -> h = +1 when y_0 is chosen, -1 when y_1 is
    base = dict(logp_0=T(-1.0), logp_1=T(-2.0), ref_0=T(-1.5), ref_1=T(-1.5), better=torch.tensor([0]),
                safer=torch.tensor([1]), len_0=T(2.0), len_1=T(3.0), reward_0=T(2.0), reward_1=T(0.0),
                cost_0=T(1.0), cost_1=T(-1.0), unsafe_0=torch.tensor([True]), unsafe_1=torch.tensor([False]))
    base.update(over)
    return SafeRows(**base)


BETA_2 = 0.1 * (1 + 0.5 * (1 - math.exp(-0.5 * 2)))  # dynamic beta at |delta| = 2, w = k = 0.5


def test_ordered_picks_the_chosen_side():
    a, b = ordered(T(1.0, 2.0), T(3.0, 4.0), torch.tensor([0, 1]))
    assert a.tolist() == [1.0, 4.0] and b.tolist() == [3.0, 2.0]


def test_mm_dpo_terms_by_hand():
    # helpful pair (better=0): h_H = 0.5 - (-0.5) = 1, delta_H = 2 - 0 = 2
    # safety pair (safer=1): h_S = -0.5 - 0.5 = -1, delta_S = C(y_l) - C(y_w) = C_0 - C_1 = 2
    loss, m = safe_rows_loss(rows(), SafeParams(lam=1.0))
    loss_h, loss_s = softplus(-BETA_2 * 1.0), softplus(BETA_2 * 1.0)
    assert m["loss_H"].item() == approx(loss_h, abs=1e-12)
    assert m["loss_S"].item() == approx(loss_s, abs=1e-12)
    assert m["beta_H"].item() == approx(BETA_2) and m["beta_S"].item() == approx(BETA_2)
    assert loss.item() == approx((loss_h + loss_s) / 2, abs=1e-12)
    loss3, _ = safe_rows_loss(rows(), SafeParams(lam=3.0))
    assert loss3.item() == approx((loss_h + 3 * loss_s) / 4, abs=1e-12)
    # KL (k1): ((0.5) + (-0.5)) / (2 + 3) = 0
    assert m["KL"].item() == approx(0.0)


def test_mm_dpo_pairs_differ_only_when_ids_differ():
    same, _ = safe_rows_loss(rows(safer=torch.tensor([0])), SafeParams(lam=1.0))
    m = safe_rows_loss(rows(safer=torch.tensor([0])), SafeParams(lam=1.0))[1]
    assert m["loss_H"].item() == approx(m["loss_S"].item())  # same pair, same |delta| -> same term
    assert same.item() == approx(m["loss_H"].item())


def test_beta_is_detached_and_lambda_a_constant():
    logp_0 = T(-1.0).requires_grad_()
    reward_0 = T(2.0).requires_grad_()
    loss, _ = safe_rows_loss(rows(logp_0=logp_0, reward_0=reward_0), SafeParams(lam=1.0))
    loss.sum().backward()
    assert reward_0.grad is None  # the frozen margin only weights the pair
    # d/dlogp_0: y_0 is chosen in the helpful pair (+beta) and rejected in the safety pair (+beta)
    # d loss_H/d h_H = -beta sigma(-beta h), h_H = +1; d loss_S / d h_S = -beta sigma(-beta h_S), h_S = -1,
    # and dh_S/dlogp_0 = -1: total/2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expect = (-BETA_2 * sig(-BETA_2) + BETA_2 * sig(BETA_2)) / 2
    assert logp_0.grad.item() == approx(expect, abs=1e-12)


def test_kl_penalty_k1_and_k3():
    r = rows(logp_0=T(-0.5), logp_1=T(-1.0))  # log-ratios +1.0 and +0.5 over 5 tokens: l = 0.3
    base, m = safe_rows_loss(r, SafeParams(lam=1.0))
    with_k1, _ = safe_rows_loss(r, SafeParams(lam=1.0, kl_coeff=0.2, kl_estimator="k1"))
    with_k3, _ = safe_rows_loss(r, SafeParams(lam=1.0, kl_coeff=0.2, kl_estimator="k3"))
    assert m["KL"].item() == approx(0.3)
    assert (with_k1 - base).item() == approx(0.2 * 0.3)
    assert (with_k3 - base).item() == approx(0.2 * (math.exp(-0.3) - 1 + 0.3))
    with pytest.raises(ValueError, match="k1"):
        safe_rows_loss(r, SafeParams(kl_coeff=0.1, kl_estimator="k2"))


def test_safe_nll_term_on_the_safer_response_when_it_is_safe():
    r = rows()  # safer = y_1 (safe): NLL = 2.0 / 3 tokens
    base, _ = safe_rows_loss(r, SafeParams(lam=1.0))
    with_nll, _ = safe_rows_loss(r, SafeParams(lam=1.0, safe_nll_coeff=0.3))
    assert (with_nll - base).item() == approx(0.3 * 2.0 / 3)
    both_unsafe = rows(unsafe_1=torch.tensor([True]))  # the safer response is unsafe too: no NLL
    a, _ = safe_rows_loss(both_unsafe, SafeParams(lam=1.0))
    b, _ = safe_rows_loss(both_unsafe, SafeParams(lam=1.0, safe_nll_coeff=0.3))
    assert torch.equal(a, b)
    r = rows(logp_1=T(-2.0).requires_grad_())
    loss, _ = safe_rows_loss(r, SafeParams(lam=1.0, safe_nll_coeff=1.0))
    grad_with = torch.autograd.grad(loss.sum(), r.logp_1)[0]
    r2 = rows(logp_1=T(-2.0).requires_grad_())
    grad_without = torch.autograd.grad(safe_rows_loss(r2, SafeParams(lam=1.0))[0].sum(), r2.logp_1)[0]
    assert (grad_with - grad_without).item() == approx(-1 / 3)  # pushes log pi(y_safer) up


def test_safedpo_swaps_an_unsafe_chosen_and_adds_the_margin():
    # better=0 but y_0 is unsafe and y_1 safe: the pair becomes (y_1, y_0), h = -1, margin +Delta
    loss, m = safe_rows_loss(rows(), SafeParams(beta=0.1, safety_margin=2.0), "safedpo")
    assert m["swapped"].item() == 1.0
    assert loss.item() == approx(softplus(-(0.1 * -1.0 + 2.0)), abs=1e-12)
    # both safe: no swap, no margin: plain DPO on the helpful pair
    loss, m = safe_rows_loss(rows(unsafe_0=torch.tensor([False])), SafeParams(beta=0.1, safety_margin=2.0), "safedpo")
    assert m["swapped"].item() == 0.0 and loss.item() == approx(softplus(-0.1), abs=1e-12)
    # chosen safe, rejected unsafe: kept, margin +Delta
    loss, _ = safe_rows_loss(rows(unsafe_0=torch.tensor([False]), unsafe_1=torch.tensor([True])),
                             SafeParams(beta=0.1, safety_margin=2.0), "safedpo")
    assert loss.item() == approx(softplus(-(0.1 + 2.0)), abs=1e-12)


def test_modpo_margin_by_hand():
    # helpful pair (y_0, y_1), h = 1; safety reward -C: (-C_w) - (-C_l) = -1 - 1 = -2
    # z = (0.1 * 1 - 0.5 * (-2)) / 0.5 = 2.2
    loss, m = safe_rows_loss(rows(), SafeParams(beta=0.1, modpo_weight=0.5), "modpo")
    assert m["margin_H"].item() == approx(2.2)
    assert loss.item() == approx(softplus(-2.2), abs=1e-12)


def test_variants_declare_what_they_read():
    assert SAFE_DPO_VARIANTS.get("mm_dpo").uses_lambda
    assert not SAFE_DPO_VARIANTS.get("safedpo").needs_cost and SAFE_DPO_VARIANTS.get("safedpo").needs_labels
    with pytest.raises(ValueError, match="needs cost"):
        safe_rows_loss(rows(cost_0=None), SafeParams(), "modpo")
    with pytest.raises(KeyError, match="mm_dpo"):
        safe_rows_loss(rows(), SafeParams(), "mm_dpoo")


def test_lambda_rises_above_threshold_falls_below_and_is_capped():
    log_lam, trace = 0.0, []
    for j_c in [0.5] * 5 + [-0.5] * 5:
        log_lam = lagrange_update(log_lam, j_c, threshold=0.0, lr=0.1, lam_max=10.0)
        trace.append(math.exp(log_lam))
    assert all(b > a for a, b in zip(trace[:5], trace[1:5]))  # rising while J_C > d
    assert all(b < a for a, b in zip(trace[4:], trace[5:]))  # falling once J_C < d
    assert trace[0] == approx(math.exp(0.05))  # ln lam = 0 + 0.1 * 1 * 0.5
    capped = 0.0
    for _ in range(200):
        capped = lagrange_update(capped, 5.0, threshold=0.0, lr=0.5, lam_max=3.0)
    assert capped == approx(math.log(3.0))
