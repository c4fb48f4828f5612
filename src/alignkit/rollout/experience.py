"""Rollout samples -> training micro-batches.

A sample is one completion of one prompt: ``prompt_ids``, ``completion_ids`` and per-token lists
(one value per completion token: ``old_logps``, ``ref_logps``, ``advantages``, ``returns``,
``values``, ``loss_mask`` (1 = trained on, 0 = a token of an unscorable completion), ``sampler_logps``
(the rollout engine's log-probs of the sampled tokens, vLLM), ...) plus
per-sequence scalars. Which fields a run's samples carry is declared by its algorithm
(``OnlineAlgorithm.token_fields`` / ``sequence_fields``): a plugin algorithm adds one by naming it, without
editing this module; a sample's other keys (``prompt``, ``log``, intermediate lists) stay out of the micro-batch.
:func:`collate_samples` right-pads them into the layout of
the log-prob forward: ``targets[b, p]`` is the token after position p for the completion positions
only (the prompt never carries loss), and every per-token field is a ``(B, T)`` float tensor holding
its values at exactly those positions, so ``flat(batch, name)`` lines up with ``forward_logps``'
``(N,)`` output token for token.
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch, at_targets

#: per-token fields every online algorithm's samples may carry (one float per completion token): the loss's
#: old / reference log-probs and advantages, the rollout's ``loss_mask`` and the engine's ``sampler_logps``
ROLLOUT_TOKEN_FIELDS = ("old_logps", "ref_logps", "advantages", "loss_mask", "sampler_logps")

Sample = dict[str, Any]


def collate_samples(samples: list[Sample], pad_token_id: int, token_fields: tuple[str, ...] = ROLLOUT_TOKEN_FIELDS,
                    sequence_fields: tuple[str, ...] = ()) -> Batch:
    """``(B, T)`` input_ids / attention_mask / targets / seq_index, ``(B,)`` response_lengths, each of
    ``token_fields`` as a ``(B, T)`` float tensor and each of ``sequence_fields`` as ``(B,)``, where the samples
    carry it (a declared field no sample has is left out). Rows are built as Python lists and turned
    into one tensor per field (a tensor per sample and field was most of a micro-sized rollout's collate)."""
    prompt = [len(s["prompt_ids"]) for s in samples]
    comp = [len(s["completion_ids"]) for s in samples]
    B, T = len(samples), max(p + c for p, c in zip(prompt, comp))
    ids = torch.tensor([s["prompt_ids"] + s["completion_ids"] + [pad_token_id] * (T - p - c)
                        for s, p, c in zip(samples, prompt, comp)], dtype=torch.long).view(B, T)
    # position t predicts token t + 1: completion token j is predicted at position p - 1 + j
    targets = torch.tensor([[IGNORE_INDEX] * (p - 1) + list(s["completion_ids"]) + [IGNORE_INDEX] * (T - p + 1 - c)
                            for s, p, c in zip(samples, prompt, comp)], dtype=torch.long).view(B, T)
    attn = (torch.arange(T).unsqueeze(0) < torch.tensor([p + c for p, c in zip(prompt, comp)]).unsqueeze(1)).long()
    extra = {f: torch.tensor([[0.0] * (p - 1) + [float(v) for v in s[f]] + [0.0] * (T - p + 1 - c)
                              for s, p, c in zip(samples, prompt, comp)], dtype=torch.float32).view(B, T)
             for f in token_fields if f in samples[0]}
    batch = Batch({"input_ids": ids, "attention_mask": attn},
                  {"targets": targets, "seq_index": torch.arange(B).unsqueeze(1).expand(-1, T).masked_fill(attn == 0, -1),
                   "response_lengths": torch.tensor(comp, dtype=torch.long), **extra})
    for f in sequence_fields:
        if f in samples[0]:
            batch[f] = torch.tensor([float(s[f]) for s in samples], dtype=torch.float32)
    return batch


def completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(B, T)`` bool: the positions whose target is a completion token."""
    return batch["targets"] != IGNORE_INDEX


def flat(batch: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A per-token field as ``(N,)`` in the row-major order of ``forward_logps``."""
    return at_targets(batch, batch[name])


def token_seq(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(N,)`` the sequence (row) of each completion token."""
    return at_targets(batch, batch["seq_index"])


def per_sequence(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[list[float]]:
    """Split a ``(N,)`` flat tensor back into one list per sequence (in row order)."""
    return [chunk.tolist() for chunk in torch.split(values.detach().float().cpu(), batch["response_lengths"].tolist())]


def micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def tokens_in(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())
