"""A correct padding-free attention for TRL's rows (issue 49, part 3), registered with transformers'
``AttentionInterface`` under :data:`NAME`.

TRL's padding-free collator concatenates a micro-batch into one row whose ``position_ids`` restart at 0 for
every example and passes no attention mask. Under SDPA or eager without flash-attn those rows can attend across
example boundaries (transformers 5.23, Qwen2: 0.46-0.55 logit difference against the rows run separately), so
such a row is not a correct training. Here the boundaries are read from ``position_ids`` once per forward (one
device read, as transformers' flash-attention path makes; cached for the other layers) and each example attends
only to itself:

* on CUDA in bf16/fp16: torch's ``varlen_attn`` called by its installed signature (alignkit's
  ``models.attention.torch_varlen``, the same call alignkit's packed rows make);
* otherwise (CPU, fp32, a torch without ``varlen_attn``): one causal SDPA call per example.

Padded batches, generation with a KV cache and rows with an attention mask go to transformers' SDPA unchanged.

usage (TRL side)::

    import trl_varlen
    name = trl_varlen.register()          # model_init_kwargs={"attn_implementation": name}
    trl_varlen.forget_each_forward(model) # the boundaries cache is per forward
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

try:
    import alignkit  # noqa: F401
except ImportError:  # a TRL child's path holds the benchmark helpers only: this checkout's src
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from alignkit.models.attention import HALF, _per_example, torch_varlen  # noqa: E402

NAME = "bench_varlen"
#: the current forward's boundaries: position_ids' (data_ptr, shape) -> (cu_seq_lens, longest, lengths)
_CACHE: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, int, list[int]]] = {}


def boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int, list[int]]:
    """(cu_seq_lens int32 (S+1,) on the row's device, the longest example, the lengths) of a packed row whose
    ``position_ids`` (1, T) restart at 0 at every example; read from the device once per forward."""
    key = (position_ids.data_ptr(), tuple(position_ids.shape))
    if key not in _CACHE:
        _CACHE.clear()
        pos = position_ids.reshape(-1).tolist()  # the one device read of the forward
        starts = [i for i, p in enumerate(pos) if p == 0] or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
        lengths = [b - a for a, b in zip(starts, starts[1:] + [len(pos)])]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        _CACHE[key] = (cu.to(position_ids.device), max(lengths), lengths)
    return _CACHE[key]


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key/value (1, H_kv, T, D) -> ((1, T, H, D), None), causal within each example."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if position_ids is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cu, longest, lengths = boundaries(position_ids)
    api = torch_varlen()
    p = dropout if module.training else 0.0
    if query.is_cuda and query.dtype in HALF and api is not None and p == 0.0:
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D)
        return api(q, k, v, cu, cu, longest, longest, scaling).unsqueeze(0), None
    return _per_example(query, key, value, lengths, p, scaling), None


def packed_row_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for a row without one (a packed row: :func:`varlen_attention` reads the boundaries itself; a
    batch without padding: SDPA's causal path); SDPA's mask for a padded batch."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register :data:`NAME` with transformers (idempotent); the ``attn_implementation`` to load models with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_row_mask)
    return NAME


def forget_each_forward(model: torch.nn.Module) -> None:
    """Clear the boundaries cache when a forward of ``model`` starts: a new batch may reuse the old one's memory."""
    model.register_forward_pre_hook(lambda *a, **k: _CACHE.clear())
