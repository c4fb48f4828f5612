"""Attention for padding-free packed rows: each packed example attends only to itself.

A packed micro-batch is one row whose ``position_ids`` restart at 0 for every example. Plain
SDPA would need a (T, T) block-diagonal mask and spend T^2 work although only sum(L_i^2) of it
is unmasked (8 examples of 150 tokens: 8x the needed attention FLOPs). ``packed_sdpa`` splits
the row at the restarts and runs causal SDPA per example instead -- the CPU analogue of
flash-attention's varlen kernel. Everything else (padded batches, generation with a KV cache)
goes to transformers' own SDPA path unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "sdpa_packed"


def _segments(position_ids: torch.Tensor | None, q_len: int, k_len: int, batch: int) -> list[int] | None:
    """Start offsets of the packed examples, or None when the row is not a packed row."""
    if position_ids is None or batch != 1 or q_len != k_len or position_ids.shape[-1] != q_len:
        return None
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    if len(starts) <= 1 or starts[0] != 0:
        return None
    return starts + [q_len]


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key/value (1, H_kv, T, D) -> output (1, T, H, D), like transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _segments(kwargs.get("position_ids"), query.shape[2], key.shape[2], query.shape[0])
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    # split, not slices: a slice's backward writes its gradient into a zeroed full-size tensor (one per
    # example, summed), split's backward is one cat of the pieces
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``sdpa_packed`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_sdpa)
        # padded batches and generation still need SDPA's masks
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
