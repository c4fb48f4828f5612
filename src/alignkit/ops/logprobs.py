"""Per-token log-probabilities without materialising full-size float32 (or any (N, V)) logits.

Two entry points:

* :func:`selective_log_softmax` takes logits a model already produced (``(..., V)``, often bf16) and
  returns ``log_softmax(logits)[index]`` in float32, computing the log-sum-exp in float32 row-chunks.
  Its backward is also chunked, so neither pass holds a float32 copy of the whole logits tensor.
* :func:`chunked_token_logps` fuses the LM head: from hidden states ``(N, H)`` and the head weight
  ``(V, H)`` it computes ``log p(target)`` chunk by chunk and recomputes each chunk's logits in
  backward, so no ``(N, V)`` tensor ever exists (the Liger / "cut cross-entropy" idea, in PyTorch);
  optionally at a sampling temperature (``logits / T``) and with each row's entropy.

Both use the identity  d log_softmax(z)[y] / dz = onehot(y) - softmax(z)  to write the backward.

Chunks are sized by memory (:func:`chunk_rows`): a byte budget of float32 logits per chunk, so a 152k-token
vocabulary gets a few hundred rows per chunk and a tiny test vocabulary the whole batch in one.

Under bf16 / fp16 autocast every LM-head matmul (forward, its one recompute in backward, both gradient
matmuls) runs in the autocast dtype; only the softmax / log-sum-exp on its result is float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from alignkit.constants import IGNORE_INDEX


#: bytes of float32 logits one chunk may hold on a GPU (any accelerator): ~880 rows of a 151,936-token
#: vocabulary (Qwen2.5), ~4k of a 32k one; GEMMs wide enough for the tensor cores. A chunk's transient peak is
#: ~2.5x this (its bf16 logits, their float32 copy, the softmax): ~1.3 GB beside an 80 GB card's activations.
CHUNK_BYTES_ACCELERATOR = 512 << 20
#: on a CPU: 32 MiB, the 1024 rows of the 8,192-token tiny model the CPU benchmarks were tuned with (smaller
#: chunks stay in the caches)
CHUNK_BYTES_CPU = 32 << 20


def chunk_rows(vocab_size: int, device: torch.device | str, *, chunk_bytes: int | None = None) -> int:
    """Rows per LM-head chunk: ``chunk_bytes`` (default :data:`CHUNK_BYTES_CPU` on a CPU, else
    :data:`CHUNK_BYTES_ACCELERATOR`) over one float32 row of ``vocab_size`` logits; at least 1."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES_CPU if torch.device(device).type == "cpu" else CHUNK_BYTES_ACCELERATOR
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs (exact tests, gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _row_views(x: Tensor) -> list[Tensor]:
    """Split ``x (..., V)`` into 2-D ``(rows, V)`` views, in row-major order, without copying.

    ``x.reshape(-1, V)`` would copy a non-contiguous input such as the shifted ``logits[:, :-1]``,
    which is the full-size copy this module exists to avoid; so recurse over the leading dim instead.
    """
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [v for sub in x.unbind(0) for v in _row_views(sub)]


def _row_chunks(x: Tensor, chunk_size: int):
    """Yield ``(flat_start, flat_stop, rows)`` with ``rows`` a ``(<=chunk_size, V)`` view of ``x``."""
    offset = 0
    for view in _row_views(x):
        for start in range(0, view.shape[0], chunk_size):
            rows = view[start : start + chunk_size]
            yield offset + start, offset + start + rows.shape[0], rows
        offset += view.shape[0]


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``log_softmax(logits, -1).gather(-1, index)`` with float32 maths in row-chunks.

    Saves ``logits`` itself (already alive in the graph that produced it, so no new memory), the
    indices and one float32 log-sum-exp per row.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor, chunk_size: int) -> Tensor:
        acc = _acc_dtype(logits.dtype)
        flat_index = index.reshape(-1)
        lse = torch.empty(flat_index.shape[0], dtype=acc, device=logits.device)
        picked = torch.empty_like(lse)
        for start, stop, rows in _row_chunks(logits, chunk_size):
            idx = flat_index[start:stop, None]
            lse[start:stop] = torch.logsumexp(rows.to(acc), dim=-1)
            picked[start:stop] = rows.gather(1, idx).squeeze(1).to(acc)
        ctx.save_for_backward(logits, flat_index, lse)
        ctx.chunk_size = chunk_size
        return (picked - lse).view(index.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, flat_index, lse = ctx.saved_tensors
        grad_flat = grad_out.reshape(-1).to(lse.dtype)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(-1, logits.shape[-1])
        for start, stop, rows in _row_chunks(logits, ctx.chunk_size):
            g = grad_flat[start:stop, None]
            # (onehot - softmax) * g, built in place on the chunk's softmax
            chunk = torch.exp(rows.to(lse.dtype) - lse[start:stop, None]).mul_(-g)
            chunk.scatter_add_(1, flat_index[start:stop, None], g)
            grad_rows[start:stop] = chunk
        return grad, None, None


def selective_log_softmax(logits: Tensor, index: Tensor, *, chunk_size: int = 512) -> Tensor:
    """Log-probability of ``index`` under ``softmax(logits)``.

    Args:
        logits: ``(..., V)`` any float dtype; may be non-contiguous (e.g. ``logits[:, :-1]``).
        index: ``(...)`` int64, every entry in ``[0, V)`` (use :func:`token_logps_from_logits` when
            labels contain ``IGNORE_INDEX``).
        chunk_size: rows per float32 chunk (a chunk costs ``chunk_size * V * 4`` bytes).

    Returns:
        ``(...)`` float32 (float64 for float64 logits).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"index shape {tuple(index.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
    return _SelectiveLogSoftmax.apply(logits, index, chunk_size)


def token_logps_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = 512) -> Tensor:
    """Per-position ``log p(labels)``; positions with ``IGNORE_INDEX`` give exactly 0 (and no grad).

    Unshifted: position t of ``logits`` scores position t of ``labels``; the caller aligns them
    (``logits[:, :-1]`` with ``labels[:, 1:]``; the slice is not copied).

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` int64 token ids or ``IGNORE_INDEX``.

    Returns:
        ``(B, T)`` float32.
    """
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    logps = selective_log_softmax(logits, safe, chunk_size=chunk_size)
    return torch.where(valid, logps, torch.zeros_like(logps))


class _ChunkedLinearLogps(torch.autograd.Function):
    """``log_softmax((hidden @ weight.T + bias) / T)[targets]`` without an (N, V) tensor, fwd or bwd.

    Saves only ``hidden``, ``weight``, ``bias``, the targets and one log-sum-exp per row; backward
    recomputes each chunk's logits (one extra matmul per chunk, the price of the memory saving). With a frozen
    head (``eager_grad_h``: LoRA, only ``hidden`` trains) there is nothing to recompute: the forward keeps the
    ``(N, H)`` basis ``(onehot - softmax(z)) / T @ W`` of each row's gradient, and backward scales it by
    ``grad_out`` (a row scale commutes with the matmul): 2 GEMMs per chunk in all instead of 3. The
    temperature divides each chunk's float32 logits (skipped at 1.0, so offline numbers are unchanged);
    with ``with_entropy`` the forward also returns each row's exact entropy of that softmax, computed from
    the same chunk (no gradient: a metric).
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int,
                temperature: float, with_entropy: bool, eager_grad_h: bool) -> tuple[Tensor, Tensor]:
        acc = _acc_dtype(hidden.dtype)
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        picked = torch.empty_like(lse)
        entropy = torch.zeros(n if with_entropy else 0, dtype=acc, device=hidden.device)
        basis = torch.empty_like(hidden) if eager_grad_h else None
        # autocast was resolved by the caller; backward must recompute exactly these logits
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_size):
                stop = min(start + chunk_size, n)
                logits = _chunk_logits(hidden[start:stop], weight, bias, acc, temperature)
                lse[start:stop] = torch.logsumexp(logits, dim=-1)
                picked[start:stop] = logits.gather(1, safe[start:stop, None]).squeeze(1)
                if with_entropy or basis is not None:
                    p = torch.exp(logits - lse[start:stop, None])  # softmax(z), z the tempered logits
                if with_entropy:  # H = lse - sum_v p_v z_v
                    entropy[start:stop] = lse[start:stop] - (p * logits).sum(-1)
                if basis is not None:  # d log p(y) / d hidden = (onehot(y) - softmax(z)) / T @ W, in place on p
                    p.neg_().scatter_add_(1, safe[start:stop, None], p.new_ones(stop - start, 1))
                    basis[start:stop] = (p.div_(temperature) if temperature != 1.0 else p).to(hidden.dtype) @ weight
        ctx.eager_grad_h = basis is not None
        ctx.save_for_backward(*((basis, valid) if basis is not None else (hidden, weight, bias, safe, valid, lse)))
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(entropy)
        zero = torch.zeros_like(lse)
        return torch.where(valid, picked - lse, zero), torch.where(valid, entropy, zero) if with_entropy else entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        if ctx.eager_grad_h:  # frozen head: the forward's basis, scaled per row
            basis, valid = ctx.saved_tensors
            g = torch.where(valid, grad_out.to(_acc_dtype(basis.dtype)), 0.0)
            return (basis * g[:, None]).to(basis.dtype), None, None, None, None, None, None, None
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_all = torch.where(valid, grad_out.to(lse.dtype), torch.zeros_like(lse))
        # grad_weight accumulates in the weight's own dtype, like a normal linear layer's .grad
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                stop = min(start + ctx.chunk_size, hidden.shape[0])
                h, g = hidden[start:stop], g_all[start:stop, None]
                logits = _chunk_logits(h, weight, bias, lse.dtype, ctx.temperature)
                # grad wrt the tempered logits z: (onehot - softmax(z)) * grad_out, in place on the softmax
                grad_logits = torch.exp(logits - lse[start:stop, None]).mul_(-g)
                grad_logits.scatter_add_(1, safe[start:stop, None], g)
                if ctx.temperature != 1.0:  # z = logits / T: the chain rule's 1 / T
                    grad_logits.div_(ctx.temperature)
                if grad_b is not None:
                    grad_b += grad_logits.sum(0).to(grad_b.dtype)
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_h is not None:
                    grad_h[start:stop] = grad_logits @ weight
                if grad_w is not None:
                    grad_w.addmm_(grad_logits.t(), h)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype, temperature: float) -> Tensor:
    """``(rows, V)`` logits of one chunk in ``acc``, divided by ``temperature`` unless it is 1.0 (then the
    exact float32 values of an untempered forward: offline log-probs stay bit-identical)."""
    logits = F.linear(h, weight, bias).to(acc)
    return logits.div_(temperature) if temperature != 1.0 else logits


def chunked_token_logps(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log p(target)`` per row of the LM head ``logits = hidden @ weight.T (+ bias)``, chunked.

    Peak extra memory is one ``(chunk_size, V)`` float32 chunk in forward and in backward; nothing of
    shape ``(N, V)`` is created or saved. Each chunk's logits are computed once in forward and once more in
    backward (the one recompute), never kept; with a frozen head (weight and bias without grad, hidden with)
    not again: the hidden states' gradient is computed in the forward. ``hidden`` and ``weight`` may each require grad or not (LoRA:
    frozen head). Rows whose target is ``IGNORE_INDEX`` give 0 and get zero gradient (cheaper still:
    pass only the rows you need, ``hidden[mask]``).

    Args:
        hidden: ``(N, H)`` (any leading dims ``(..., H)`` are flattened), same dtype as ``weight``
            (under autocast both are cast to the autocast dtype, as ``nn.Linear`` would be).
        weight: ``(V, H)`` the output-embedding / lm_head weight.
        targets: ``(N,)`` (or ``(...)`` matching ``hidden``) int64 ids in ``[0, V)`` or ``IGNORE_INDEX``.
        bias: optional ``(V,)``.
        chunk_size: rows per chunk; 0 = by memory (:func:`chunk_rows` of the vocabulary on this device).
        temperature: the distribution is ``softmax(logits / temperature)`` (a sampler's temperature, as TRL's
            ``logits.div_(self.temperature)``); 1.0 skips the division, so results are bit-identical to an
            untempered head.
        with_entropy: also return each row's entropy ``-sum_v p_v log p_v`` of that softmax (no gradient).

    Returns:
        ``(N,)`` (or ``(...)``) float32 log-probs (float64 for float64 inputs); with ``with_entropy`` the
        pair (log-probs, entropies), entropies of the same shape (0 where the target is ``IGNORE_INDEX``).
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 1 (or 0: by memory), got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden (..., {hidden.shape[-1]}) does not match weight {tuple(weight.shape)} (V, H)")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != hidden shape[:-1] {tuple(hidden.shape[:-1])}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # behave like nn.Linear under autocast: matmul in the autocast dtype (casts are differentiable)
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if not (hidden.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)):
        raise ValueError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share one dtype")
    rows = chunk_size or chunk_rows(weight.shape[0], hidden.device)
    # a frozen head under autograd (LoRA): the hidden states' gradient is computed in the forward, no recompute
    frozen_head = not weight.requires_grad and (bias is None or not bias.requires_grad)
    eager = torch.is_grad_enabled() and hidden.requires_grad and frozen_head
    flat, entropy = _ChunkedLinearLogps.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
                                              rows, float(temperature), with_entropy, eager)
    if with_entropy:
        return flat.view(targets.shape), entropy.view(targets.shape)
    return flat.view(targets.shape)
