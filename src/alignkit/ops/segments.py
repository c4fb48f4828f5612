"""Per-sequence reductions over token positions, for padded and padding-free (packed) layouts.

A micro-batch of S sequences is described by ``seq_index`` ``(B, T)``: the sequence each position
belongs to (``0..S-1``), or ``-1`` for padding. The same code then serves

* right padding: row i holds sequence i, padding at the end;
* left padding:  row i holds sequence i, padding at the start (``seq_index_from_attention_mask``);
* packed:        one row (B=1) holds all S sequences back to back (``TokenCollator(packed=True)``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def seq_index_from_attention_mask(attention_mask: Tensor) -> Tensor:
    """``(B, T)`` 0/1 mask (left or right padded, one sequence per row) -> ``(B, T)`` seq_index."""
    rows = torch.arange(attention_mask.shape[0], device=attention_mask.device).unsqueeze(1)
    return rows.expand_as(attention_mask).masked_fill(attention_mask == 0, -1)


def last_positions(seq_index: Tensor, num_seqs: int) -> Tensor:
    """Flat index (into ``seq_index.reshape(-1)``) of the last position of every sequence, ``(S,)``.

    "Last" is the largest flat position carrying the sequence's id, i.e. its last non-pad token,
    whichever side the padding is on. Every sequence must hold a position: the collators check that on
    the host (``data.collate.TokenCollator``), so nothing here reads the device (no boolean indexing, no
    check of the result; a sequence without a position would get -1): padding goes to a spare slot S that
    is dropped.
    """
    flat = seq_index.reshape(-1)
    slot = torch.where(flat >= 0, flat, num_seqs)
    pos = torch.arange(flat.numel(), device=flat.device)
    out = torch.full((num_seqs + 1,), -1, dtype=torch.long, device=flat.device)
    return out.scatter_reduce(0, slot, pos, reduce="amax", include_self=True)[:num_seqs]


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """``out[s] = sum(values[segment_ids == s])``, ``(N,) -> (S,)``; differentiable in ``values``.

    Used for per-sequence log-prob sums: ``values`` are per-token log-probs of the loss tokens and
    ``segment_ids`` the sequence each token belongs to (``seq_index`` at those positions).
    """
    if values.shape != segment_ids.shape:
        raise ValueError(f"segment_sum: values {tuple(values.shape)} and ids {tuple(segment_ids.shape)} differ")
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, segment_ids, values)
