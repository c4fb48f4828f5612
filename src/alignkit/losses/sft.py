"""Supervised fine-tuning (next-token cross-entropy) from per-token log-probabilities."""

from __future__ import annotations

from torch import Tensor


def sft_loss(token_logps: Tensor, *, normalizer: float) -> Tensor:
    """``-sum(token_logps) / normalizer`` (a scalar).

    Args:
        token_logps: ``(N,)`` (any shape) log p of each loss token; ignored positions must already be
            0 (``ops.token_logps_from_logits`` / ``chunked_token_logps`` give 0 for ``IGNORE_INDEX``).
        normalizer: the number of loss tokens of the WHOLE optimizer step (all micro-batches, all
            ranks) divided by ``dp_size``, because data parallelism averages gradients over ranks
            (ALGORITHMS 6.1). Do not also divide by the accumulation steps.
    """
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (global loss tokens / dp_size), got {normalizer}")
    return -token_logps.sum() / normalizer
