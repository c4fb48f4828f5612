"""Micro-batch assembly: right padding, or padding-free packing with per-example positions.

Both layouts yield ``targets`` already shifted per example (``targets[t]`` is the token the
model must predict after position t, or IGNORE_INDEX), so a packed row never asks the last
token of one example to predict the first token of the next.

A packed row also carries its example boundaries as model inputs, computed here on the host once per
batch (:func:`packed_boundaries`), so no layer has to ask the device where the examples start (a GPU
would wait for the host at every such question).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch

#: Model-input names of a packed row's boundaries. ``cu_seq_lens_q/k`` (int32 ``(S+1,)``, moved to the device
#: with the batch) and ``max_length_q/k`` (ints) are transformers' own names: its flash-attention integration
#: reads them from the forward's ``**kwargs``. ``packed_seq_lens`` (a tuple of ints) stays on the host
#: (``Batch.to`` moves tensors only) for kernels that split the row in Python (``models.attention``).
CU_SEQ_LENS_Q, CU_SEQ_LENS_K = "cu_seq_lens_q", "cu_seq_lens_k"
MAX_LENGTH_Q, MAX_LENGTH_K = "max_length_q", "max_length_k"
PACKED_SEQ_LENS = "packed_seq_lens"
PACKED_KEYS = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, PACKED_SEQ_LENS)


def packed_boundaries(lengths: list[int]) -> dict[str, Any]:
    """The model inputs that describe one packed row of examples of ``lengths`` tokens (:data:`PACKED_KEYS`)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=cu[1:])
    longest = max(lengths)
    return {CU_SEQ_LENS_Q: cu, CU_SEQ_LENS_K: cu, MAX_LENGTH_Q: longest, MAX_LENGTH_K: longest,
            PACKED_SEQ_LENS: tuple(lengths)}


def shift_labels(labels: list[int]) -> list[int]:
    """targets[t] = labels[t+1]; the last position predicts nothing."""
    return labels[1:] + [IGNORE_INDEX]


@dataclass
class TokenCollator:
    """Collates examples ``{"input_ids": [...], "labels": [...]}`` (plus optional per-example extras).

    ``packed=True`` concatenates the micro-batch into one row (B=1) with ``position_ids`` that
    restart at 0 for every example, and the row's boundaries (:func:`packed_boundaries`): the attention
    kernels (``models.attention``) attend within each example only, and no compute is spent on padding.
    ``multiple`` > 1 pads a packed row up to a multiple of that many tokens with one padding segment (its own
    boundaries, positions from 0, ``seq_index`` -1, no targets): few distinct row lengths for a compiled model.
    """

    pad_token_id: int
    packed: bool = False
    multiple: int = 1

    def __call__(self, examples: list[dict[str, Any]]) -> Batch:
        # every sequence holds a position, checked here on the host: per-sequence reads on the device
        # (ops.segments.last_positions) rely on it instead of asking the device
        empty = next((i for i, e in enumerate(examples) if not e["input_ids"]), None)
        if empty is not None:
            raise ValueError(f"TokenCollator: example {empty} of the micro-batch has no tokens")
        if self.packed:
            return self._packed(examples)
        return self._padded(examples)

    def _padded(self, examples: list[dict[str, Any]]) -> Batch:
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"])
            targets[i, :n] = torch.tensor(shift_labels(e["labels"]))
            attn[i, :n] = 1
        seq_index = torch.arange(len(examples)).unsqueeze(1).expand(-1, width).masked_fill(attn == 0, -1)
        return Batch({"input_ids": ids, "attention_mask": attn}, {"targets": targets, "seq_index": seq_index})

    def _packed(self, examples: list[dict[str, Any]]) -> Batch:
        ids: list[int] = []
        targets: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids += e["input_ids"]
            targets += shift_labels(e["labels"])
            pos += list(range(n))
            seq += [i] * n
        lengths = [len(e["input_ids"]) for e in examples]
        pad = -len(ids) % self.multiple
        if pad:
            ids += [self.pad_token_id] * pad
            targets += [IGNORE_INDEX] * pad
            pos += list(range(pad))
            seq += [-1] * pad
            lengths.append(pad)
        inputs = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]),
                  **packed_boundaries(lengths)}
        return Batch(inputs, {"targets": torch.tensor([targets]), "seq_index": torch.tensor([seq])})


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["targets"] != IGNORE_INDEX).sum())
