"""The trainable policy module, and the one way every algorithm runs a model on a batch.

``CausalLMLogps``: an HF causal LM (or VLM) whose forward returns per-token log-probs. Log-probs
are computed inside ``forward`` (so DDP / FSDP see every parameter use) from the final hidden
states at the positions that have a target, through the chunked LM-head op: the (batch, seq,
vocab) logits tensor is never built.

``forward_logps`` / ``forward_scores`` / ``token_values`` pass the batch's declared model inputs
through (``pixel_values``, ``image_sizes``, ... included; :class:`~alignkit.data.batch.Batch`): the
algorithm's own fields (targets, advantages, cached values) never reach a forward. So a VLM batch
needs no new path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch, at_targets, model_inputs, select_targets
from alignkit.errors import ModelError
from alignkit.models.attention import packed_model_inputs
from alignkit.models.liger import liger_nll_sum
from alignkit.models.loading import split_lm
from alignkit.models.vlm import image_free_anchor
from alignkit.ops.logprobs import chunked_token_logps
from alignkit.ops.segments import segment_sum


def final_hidden(backbone: nn.Module, hf_model: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """``(B, T, H)`` final hidden states of ``backbone`` (the model without its head), KV cache off; a VLM
    batch without images keeps the trained projector in the backward (``models.vlm.image_free_anchor``). A packed
    row skips transformers' mask creation where the model's attention reads the collator's boundaries instead
    (``models.attention.packed_model_inputs``: no device read, no (T, T) mask)."""
    inputs = packed_model_inputs(hf_model, inputs, input_ids.device)
    out = backbone(input_ids=input_ids, use_cache=False, **inputs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    anchor = image_free_anchor(hf_model, inputs, input_ids.device)
    return hidden if anchor is None else hidden + anchor


class CausalLMLogps(nn.Module):
    def __init__(self, hf_model: nn.Module, chunk_size: int = 0) -> None:
        """``chunk_size``: rows per LM-head chunk; 0 = by memory (``ops.logprobs.chunk_rows``)."""
        super().__init__()
        self.hf_model = hf_model
        self.chunk_size = chunk_size

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                with_entropy: bool = False, liger_nll: bool = False, target_index: torch.Tensor | None = None,
                full_vocab: bool = False, on_hidden: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                **inputs: Any) -> Any:
        """log p(targets) at every position whose target is not IGNORE_INDEX, under ``softmax(logits / temperature)``.

        input_ids, targets: (B, T); ``inputs``: any other model inputs (attention_mask,
        position_ids, pixel_values, ...); ``target_index``: the batch's host-computed flat positions of the
        targets (``Batch.to``), so picking them needs no boolean mask (a device sync). ``temperature`` and
        ``with_entropy`` are arguments of the call, never batch inputs (1.0: the model's own distribution, as offline algorithms use it). Returns (N,)
        float32 in row-major order of those positions; with ``with_entropy`` also (N,) the exact entropy of
        the tempered next-token distribution at each of them (no gradient), from the same LM-head chunks.
        With ``liger_nll`` instead the scalar float32 sum of ``-log p(targets)`` through Liger-Kernel's fused
        linear cross-entropy (``training.liger_kernel``; temperature 1). With ``full_vocab`` the ``(N, V)`` float32
        log-probs of the whole tempered distribution at those positions (on-policy distillation; builds the
        (N, V) logits, so for vocabularies that fit). With ``on_hidden`` whatever ``on_hidden(hidden, head_weight)``
        returns, given the ``(N, H)`` final hidden states at those positions and the LM head's ``(V, H)`` weight,
        inside this forward (so DDP sees the head's use): on-policy distillation's chunked divergence.
        """
        backbone, head = split_lm(self.hf_model)
        hidden = final_hidden(backbone, self.hf_model, input_ids, inputs)  # (B, T, H)
        hidden, targets = (select_targets(x, targets, target_index) for x in (hidden, targets))
        if full_vocab:
            return torch.log_softmax(head(hidden).float() / temperature, dim=-1)
        if on_hidden is not None:
            if getattr(head, "bias", None) is not None:
                raise ModelError(f"{type(self.hf_model).__name__}: its LM head has a bias, which the hidden-state path "
                                 "(distill.chunk_tokens) does not apply; set distill.chunk_tokens: 0")
            return on_hidden(hidden, head.weight)
        if liger_nll:
            return liger_nll_sum(hidden, head.weight, targets, bias=getattr(head, "bias", None))
        return chunked_token_logps(
            hidden, head.weight, targets, bias=getattr(head, "bias", None), chunk_size=self.chunk_size,
            temperature=temperature, with_entropy=with_entropy,
        )


def forward_logps(model: nn.Module, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
                  full_vocab: bool = False, on_hidden: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> Any:
    """``(N,)`` log-probs of the batch's targets (row-major over non-ignored positions) under ``logits /
    temperature``; with ``with_entropy`` the pair (log-probs, ``(N,)`` entropies); with ``full_vocab`` the
    ``(N, V)`` log-probs of every token there; with ``on_hidden`` its value on the hidden states and the head's
    weight (``CausalLMLogps.forward``)."""
    extra: dict[str, Any] = {"full_vocab": True} if full_vocab else {}  # only where asked: other forwards need not know it
    if on_hidden is not None:
        extra["on_hidden"] = on_hidden
    return model(targets=batch["targets"], temperature=temperature, with_entropy=with_entropy,
                 target_index=batch.get("target_index"), **extra, **model_inputs(batch))


def forward_liger_nll(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Scalar float32 sum of ``-log p`` over the batch's targets through Liger's fused head loss
    (``CausalLMLogps.forward`` with ``liger_nll``): what ``-forward_logps(model, batch).sum()`` computes."""
    return model(targets=batch["targets"], liger_nll=True, target_index=batch.get("target_index"),
                 **model_inputs(batch))


def sequence_sums(token_logps: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``(S,)`` sums of ``(N,)`` target log-probs per sequence (``seq_index``; S = ``len(response_lengths)``)."""
    seq = at_targets(batch, batch["seq_index"])
    return segment_sum(token_logps, seq, int(batch["response_lengths"].shape[0]))


def sequence_logps(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``(S,)`` per-sequence sums of ``model``'s target log-probs (algorithms use ``Models.sequence_logps``)."""
    return sequence_sums(forward_logps(model, batch), batch)


def forward_scores(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``(S,)`` scalar-head scores, one per sequence of ``seq_index`` (reward / cost / value models)."""
    return model(seq_index=batch["seq_index"], num_seqs=int(batch["response_lengths"].shape[0]), **model_inputs(batch))


def token_values(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``(N,)`` a scalar-head model's value at every target position (a PPO critic's V(s_t)), in the
    row-major order of :func:`forward_logps`."""
    return model(seq_index=batch["seq_index"], num_seqs=int(batch["response_lengths"].shape[0]),
                 positions=batch["targets"] != IGNORE_INDEX, target_index=batch.get("target_index"),
                 **model_inputs(batch))
