"""Flow matching against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses.flow import flow_matching_loss, noisy_latents, sample_sigmas


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

