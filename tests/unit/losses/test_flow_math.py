"""Flow matching and Flow-GRPO's SDE step against hand computations and closed-form Gaussian densities."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses.flow import flow_matching_loss, noisy_latents, sample_sigmas
from alignkit.ops.flow_sde import sde_step


def test_noisy_latents_mix_data_and_noise_per_sample() -> None:
    x0, noise = torch.tensor([[2.0, 4.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [3.0, -1.0]])
    got = noisy_latents(x0, noise, torch.tensor([0.25, 0.5]))
    assert torch.allclose(got, torch.tensor([[1.5, 3.0], [2.0, 0.0]]))


def test_flow_matching_loss_by_hand() -> None:
    # sample 0: target = noise - x0 = (-2, -4), v = (0, 0): mean((2, 4)^2) = 10
    # sample 1: target = (2, -2), v = (1, -2): mean((1, 0)^2) = 0.5
    x0, noise = torch.tensor([[2.0, 4.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [3.0, -1.0]])
    v = torch.tensor([[0.0, 0.0], [1.0, -2.0]], requires_grad=True)
    loss, per = flow_matching_loss(v, x0, noise, normalizer=4.0)
    assert torch.allclose(per, torch.tensor([10.0, 0.5]))
    assert math.isclose(float(loss.detach()), 10.5 / 4)
    loss.backward()  # d/dv of sum_i mean_j (v - t)^2 / 4 = 2 (v - t) / (2 x 4)
    assert torch.allclose(v.grad, torch.tensor([[0.5, 1.0], [-0.25, 0.0]]))
    with pytest.raises(ValueError, match="normalizer"):
        flow_matching_loss(v, x0, noise, normalizer=0.0)


def test_sigma_sampling_is_seeded_and_inside_the_unit_interval() -> None:
    for scheme in ("logit_normal", "uniform"):
        a = sample_sigmas(1000, torch.Generator().manual_seed(0), scheme=scheme)
        b = sample_sigmas(1000, torch.Generator().manual_seed(0), scheme=scheme)
        assert torch.equal(a, b) and bool(((a > 0) & (a < 1)).all())
    ln = sample_sigmas(20000, torch.Generator().manual_seed(1), scheme="logit_normal", mean=0.0, std=1.0)
    assert abs(float(ln.mean()) - 0.5) < 0.01  # symmetric about 1/2 for mean 0


def test_sde_step_by_hand_on_one_element() -> None:
    # sigma 0.5 -> 0.25, a = 0.7: std_t = 0.7 sqrt(0.5 / 0.5) = 0.7, dt = -0.25
    # mean = x (1 + 0.49 / 1 x -0.25) + v (1 + 0.49 x 0.5 / 1) x -0.25 = 2 x 0.8775 + 1 x 1.245 x -0.25 = 1.44375
    # std = 0.7 x 0.5 = 0.35; x_next = mean + 0.35 x eps (eps = 2) = 2.14375
    # log p = -(0.7)^2 / (2 x 0.1225) - log 0.35 - log sqrt(2 pi) = -2 - log 0.35 - 0.918939
    out = sde_step(torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([0.5]), torch.tensor([0.25]),
                   noise_level=0.7, noise=torch.tensor([[2.0]]))
    assert math.isclose(float(out.mean), 1.44375, rel_tol=1e-6)
    assert math.isclose(float(out.std), 0.35, rel_tol=1e-6)
    assert math.isclose(float(out.sample), 2.14375, rel_tol=1e-6)
    want = -2.0 - math.log(0.35) - 0.5 * math.log(2 * math.pi)
    assert math.isclose(float(out.logp), want, rel_tol=1e-6)


def test_sde_step_logp_is_the_gaussian_density_of_the_transition_averaged_over_elements() -> None:
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1])
    out = sde_step(v, x, sigma, sigma_next, noise_level=0.7, sigma_cap=0.9, noise=torch.randn(3, 4, 2, 2, generator=g))
    normal = torch.distributions.Normal(out.mean, out.std.reshape(-1, 1, 1, 1))
    direct = normal.log_prob(out.sample).flatten(1).mean(dim=1)
    assert torch.allclose(out.logp, direct, atol=1e-5)
    # sigma = 1 uses the cap under the root: std_t = 0.7 sqrt(1 / (1 - 0.9))
    assert math.isclose(float(out.std[0]), 0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.2), rel_tol=1e-5)
    # the stored transition scored again under an unchanged policy: the same log-prob (ratio 1)
    again = sde_step(v, x, sigma, sigma_next, noise_level=0.7, sigma_cap=0.9, next_sample=out.sample)
    assert torch.allclose(again.logp, out.logp) and torch.equal(again.sample, out.sample)
    # a moved policy: another log-prob of the same transition, and a gradient through the mean only
    v2 = (v + 0.1).requires_grad_(True)
    moved = sde_step(v2, x, sigma, sigma_next, noise_level=0.7, sigma_cap=0.9, next_sample=out.sample)
    assert not torch.allclose(moved.logp, out.logp)
    moved.logp.sum().backward()
    assert v2.grad is not None and bool(torch.isfinite(v2.grad).all())
    with pytest.raises(ValueError, match="sigma_next must be below sigma"):
        sde_step(v, x, sigma_next, sigma)


def test_flow_grpo_loss_by_hand() -> None:
    from alignkit.losses.flow import flow_grpo_loss

    # pair 0: rho = e^0.1 = 1.10517, A = 1: max(-1.10517, -1 x clip(rho, 0.9, 1.1) = -1.1) = -1.1 (clipped)
    # pair 1: rho = 1, A = -2: max(2, 2) = 2; pair 2: rho = e^-0.05 = 0.95123, A = 0.5: max(-0.47561, -0.47561)
    logp = torch.tensor([0.1, 0.0, -0.05], requires_grad=True)
    old, adv = torch.zeros(3), torch.tensor([1.0, -2.0, 0.5])
    loss, parts = flow_grpo_loss(logp, old, adv, clip_range=0.1, normalizer=2.0)
    want = [-1.1, 2.0, -0.5 * math.exp(-0.05)]
    assert torch.allclose(parts["policy"], torch.tensor(want))
    assert math.isclose(float(loss.detach()), sum(want) / 2, rel_tol=1e-6)
    assert parts["clipped"].tolist() == [1.0, 0.0, 0.0] and torch.equal(parts["kl"], torch.zeros(3))
    loss.backward()  # the clipped pair carries no gradient; d/dlogp of -A rho / 2 = -A rho / 2
    assert torch.allclose(logp.grad, torch.tensor([0.0, 1.0, -0.25 * math.exp(-0.05)]))
    with pytest.raises(ValueError, match="normalizer"):
        flow_grpo_loss(logp, old, adv, clip_range=0.1, normalizer=0.0)


def test_flow_grpo_loss_ratio_one_and_kl_term() -> None:
    from alignkit.losses.flow import flow_grpo_loss

    # an unmoved policy: rho = 1 exactly, the loss is -mean(A) whatever the clip range, nothing clipped
    logp = torch.tensor([-1.3, 0.7])
    loss, parts = flow_grpo_loss(logp, logp.clone(), torch.tensor([0.5, 1.5]), clip_range=1e-4, normalizer=2.0)
    assert torch.equal(parts["ratio"], torch.ones(2)) and float(loss) == pytest.approx(-1.0)
    assert parts["clipped"].sum() == 0
    # KL: mean_elements((mean - ref)^2) / (2 std_t^2): (1^2 + 3^2) / 2 / (2 x 0.25) = 10; 0 where the means agree
    mean, ref = torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.tensor([[0.0, 0.0], [2.0, 2.0]])
    loss, parts = flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.1, normalizer=1.0,
                                 mean=mean, ref_mean=ref, std_t=torch.tensor([0.5, 0.5]), beta=0.1)
    assert torch.allclose(parts["kl"], torch.tensor([10.0, 0.0])) and float(loss) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ref_mean"):
        flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.1, normalizer=1.0, beta=0.1)


def test_ode_step_is_the_euler_step() -> None:
    from alignkit.ops.flow_sde import ode_step

    x, v = torch.tensor([[2.0, -1.0]]), torch.tensor([[4.0, 1.0]])
    assert torch.allclose(ode_step(v, x, torch.tensor([0.75]), torch.tensor([0.5])), torch.tensor([[1.0, -1.25]]))
