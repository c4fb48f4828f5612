"""Hand-computed values of on-policy distillation's generalised JSD (losses/distill.py)."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.losses.distill import generalized_jsd

S = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))  # student: two positions over a vocabulary of 2
T = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))  # teacher: differs at the first position only


def test_reverse_and_forward_kl():
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(student || teacher), beta 1
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(teacher || student), beta 0
    assert torch.allclose(generalized_jsd(S, T, beta=1.0), torch.tensor([reverse, 0.0]), atol=1e-6)
    assert torch.allclose(generalized_jsd(S, T, beta=0.0), torch.tensor([forward, 0.0]), atol=1e-6)


def test_jsd_at_one_half_and_gradient():
    m = [0.375, 0.625]  # mixture 0.5 teacher + 0.5 student at position 0
    want = 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])) \
        + 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    student = S.clone().requires_grad_()
    jsd = generalized_jsd(student, T, beta=0.5)
    assert torch.allclose(jsd, torch.tensor([want, 0.0]), atol=1e-6)
    jsd.sum().backward()
    assert student.grad[1].abs().max() < 1e-6 and student.grad[0].abs().max() > 1e-3  # equal distributions: no pull
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(S, T, beta=1.5)
