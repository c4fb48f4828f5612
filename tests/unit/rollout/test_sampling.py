"""The rollout sampler (inverse-CDF draws inside generate's greedy step): the same distribution as
softmax(logits / T) restricted by top-k / top-p, every row its own draw, and generate takes its tokens."""

from __future__ import annotations

import torch

from alignkit.rollout.engine import InverseCDFSampler, SamplingParams, sampling_kwargs


def _draws(sampler: InverseCDFSampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Token counts of ``n`` draws for each row of ``logits``: (rows, vocab)."""
    counts = torch.zeros_like(logits)
    for _ in range(n):
        out = sampler(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())
        assert torch.equal((out == 0).sum(-1), torch.ones(logits.shape[0], dtype=torch.long))  # one token per row
        assert torch.isinf(out).sum() == out.numel() - logits.shape[0]
        counts.scatter_add_(1, out.argmax(-1, keepdim=True), torch.ones(logits.shape[0], 1))
    return counts


def test_draws_follow_the_tempered_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 2
    n = 6000
    counts = _draws(InverseCDFSampler(0.7), logits, n)
    p = torch.softmax(logits / 0.7, -1)
    # Pearson chi-square per row, 11 degrees of freedom: the 0.999 quantile is 31.3
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum(-1)
    assert (chi2 < 31.3).all(), chi2
    assert not torch.equal(counts[0], counts[1])  # rows draw independently


def test_top_k_and_top_p_keep_only_their_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    counts = _draws(InverseCDFSampler(1.0, top_k=2), logits, 2000)
    assert counts[0, 2:].sum() == 0 and counts[0, :2].min() > 0
    # top-p 0.9: the smallest set of the most likely tokens holding >= 90% of the mass
    p = torch.softmax(logits, -1)[0]
    keep = int((p.cumsum(0) < 0.9).sum()) + 1
    counts = _draws(InverseCDFSampler(1.0, top_p=0.9), logits, 2000)
    assert counts[0, keep:].sum() == 0 and counts[0, :keep].min() > 0


def test_greedy_needs_no_sampler_and_generate_takes_the_draws(micro_model: object) -> None:
    from transformers import AutoModelForCausalLM

    assert "logits_processor" not in sampling_kwargs(SamplingParams(4, 0.0))
    model = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    ids = torch.tensor([[5, 6, 7, 8]] * 4)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    torch.manual_seed(3)
    a = model.generate(**{**sampling_kwargs(SamplingParams(6, 1.0)), **kw})  # kw's min_new_tokens wins
    torch.manual_seed(3)
    b = model.generate(**{**sampling_kwargs(SamplingParams(6, 1.0)), **kw})
    greedy = model.generate(**{**sampling_kwargs(SamplingParams(6, 0.0)), **kw})
    assert torch.equal(a, b)  # seeded: reproducible
    assert len({tuple(r) for r in a[:, 4:].tolist()}) > 1  # the 4 identical prompts get different samples
    assert len({tuple(r) for r in greedy[:, 4:].tolist()}) == 1
