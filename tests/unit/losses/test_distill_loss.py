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


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s output and the bytes of the distinct tensors autograd keeps for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_from_hidden_states_equals_the_full_vocabulary_path(beta):
    """Values and gradients (hidden states and head) to 1e-6, with 37 positions in chunks of 8 (a ragged last one);
    and memory: the full path keeps (N, V) tensors for the backward (>= 2 x N x V x 4 bytes: student and teacher
    log-probs), the chunked one keeps nothing of size V beyond its inputs (measured: saved bytes < the head's)."""
    from alignkit.losses.distill import chunked_generalized_jsd

    g = torch.Generator().manual_seed(0)
    n, h, v, t = 37, 16, 500, 0.7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    head = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    teacher_logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 2

    def full() -> torch.Tensor:
        s = torch.log_softmax(hidden @ head.T / t, dim=-1)
        return generalized_jsd(s, torch.log_softmax(teacher_logits / t, dim=-1), beta=beta)

    want, full_saved = saved_bytes(full)
    grads = torch.autograd.grad(want.sum(), [hidden, head])
    got, chunk_saved = saved_bytes(lambda: chunked_generalized_jsd(
        hidden, head, lambda a, b: teacher_logits[a:b], beta=beta, temperature=t, chunk_tokens=8))
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    for a, b in zip(torch.autograd.grad(got.sum(), [hidden, head]), grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    low = chunked_generalized_jsd(hidden.detach().bfloat16(), head.detach().bfloat16(),
                                  lambda a, b: teacher_logits[a:b].bfloat16(), beta=beta, chunk_tokens=8)
    assert low.dtype == torch.float32  # bf16 logits: the divergence in float32
    assert full_saved >= 2 * n * v * 8  # float64 here: the student's and the teacher's (N, V) at least
    assert chunk_saved <= hidden.numel() * 8 + head.numel() * 8, (chunk_saved, full_saved)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_path_against_the_hand_computed_values(beta):
    """The chunked path with an identity head (hidden states = the student's log-probs, V = H = 2), one position per
    chunk, against the hand-computed divergences of the tests above at beta 0, 0.5 and 1."""
    from alignkit.losses.distill import chunked_generalized_jsd

    m = [0.375, 0.625]
    want = {1.0: 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
            0.0: 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5),
            0.5: 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1]))
            + 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))}[beta]
    got = chunked_generalized_jsd(S.clone(), torch.eye(2), lambda a, b: T[a:b], beta=beta, chunk_tokens=1)
    assert torch.allclose(got, torch.tensor([want, 0.0]), atol=1e-6), (got, want)
