"""PKU-SafeRLHF rows for safety-constrained DPO (``algorithm: safe_dpo``; ALGORITHMS 1.5, 1.7).

A row ``{prompt, response_0, response_1, better_response_id, safer_response_id, is_response_0_safe,
is_response_1_safe}`` holds TWO preference pairs over the same two responses: the helpful pair
(chosen = ``response_{better_response_id}``) and the safety pair (chosen = ``response_{safer_response_id}``).
They differ whenever the two ids differ. The example keeps the two responses once, in their row order
(``chosen_ids`` = response_0, ``rejected_ids`` = response_1, so :class:`PairCollator`, the reference
log-prob cache and the frozen scorers work unchanged), plus the two ids and the labels; the loss
builds both pairs as index views of the two log-prob sums (``losses.safe_dpo.ordered``), so each
response goes through the policy once. BeaverTails-V rows (image + text: ``question``, ``response_1/2``,
ids 1 / 2, harmless rates) are read the same way; with a vision-language model's processor the images
go with the pair (``data.preference``).

Example fields beyond :func:`~alignkit.data.preference.encode_pair`'s: ``better_id``, ``safer_id``,
``prompt`` (the raw prompt, for on-policy generation) and, once cached by the algorithm,
``reward_0/1`` (helpful RM) and ``cost_0/1`` (cost model). The collated batch adds ``better_id``,
``safer_id`` ``(B,)`` and ``reward`` / ``cost`` ``(2B,)`` (response_0 scores, then
response_1) when every example carries them.
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.io import DataError, Row, RowCounts, convert_rows
from alignkit.data.preference import (
    PairCollator,
    PairText,
    TwoResponseRow,
    count_pairs,
    encode_pair,
    row_images,
    two_response_fields,
    two_response_row,
)
from alignkit.data.tokenize import _ids, render_chat
from alignkit.data.vlm import PixelCache

SAFETY_FIELDS = ("safer_response_id", "is_response_0_safe", "is_response_1_safe")


def safety_row(row: Row) -> TwoResponseRow:
    """Read a PKU-SafeRLHF (or BeaverTails-V) row; a missing response, id or safety label is a one-line
    DataError."""
    d = row.data
    fields = two_response_fields(row)
    if fields is None:
        raise DataError(f"{row.where()}: safe_dpo needs PKU-SafeRLHF rows (prompt, response_0, response_1, "
                        f"better_response_id, safer_response_id, is_response_0_safe, is_response_1_safe) or "
                        f"BeaverTails-V rows; row has {sorted(d)}")
    needed = (fields.better, fields.safer, *(fields.harmless or fields.safe or ()))
    missing = [k for k in needed if k not in d or d[k] is None]
    if missing:
        raise DataError(f"{row.where()}: safe_dpo needs the safety ids and labels of every row; missing "
                        f"{', '.join(repr(k) for k in missing)}")
    return two_response_row(row, fields, better=True, safer=True, labels=True)


def safety_example(tokenizer: Any, row: Row, *, max_length: int, chat_template: bool, processor: Any = None,
                   image_root: str | None = None) -> dict[str, Any] | None:
    """A row -> ``encode_pair`` of (response_0, response_1) plus ids, labels and the raw prompt (and its
    images, for a vision-language model)."""
    s = safety_row(row)
    both = PairText(s.prompt, s.responses[0], s.responses[1], None, s.unsafe[0], s.unsafe[1])
    ex = encode_pair(tokenizer, both, row, max_length=max_length, chat_template=chat_template,
                     images=row_images(processor, row, image_root))
    if ex is None:
        return None
    ex.update(better_id=s.better, safer_id=s.safer, prompt=s.prompt)
    return ex


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]], *, chat_template: bool) -> list[int]:
    """The prompt's tokens exactly as training encodes them before the response (``encode_prompt_response``):
    plain text with the tokenizer's special prefix, or the chat with the assistant turn opened."""
    if isinstance(prompt, list) or chat_template:
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return _ids(tokenizer, render_chat(tokenizer, msgs, add_generation_prompt=True))
    return _ids(tokenizer, prompt, add_special_tokens=True)


class SafetyData:
    """PKU-SafeRLHF rows for ``safe_dpo``: one example per row (both pairs), loss unit = row."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, processor: Any = None) -> None:
        self.tokenizer, self.cfg, self.processor = tokenizer, cfg, processor
        self.pixels = PixelCache()  # a VLM's preprocessed images, read once over the epochs
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg
        limit = d.max_train_examples if split == "train" else d.max_eval_examples
        examples, counts = convert_rows(
            specs, lambda row: safety_example(self.tokenizer, row, max_length=d.max_length, chat_template=d.chat_template,
                                              processor=self.processor, image_root=d.image_root),
            skip_invalid=d.skip_invalid, limit=limit,
        )
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = PairCollator(self.tokenizer.pad_token_id, packed=True, processor=self.processor,
                             cache=self.pixels)(examples)
        batch["better_id"] = torch.tensor([int(e["better_id"]) for e in examples])
        batch["safer_id"] = torch.tensor([int(e["safer_id"]) for e in examples])
        for name in ("reward", "cost"):
            if all(f"{name}_0" in e for e in examples):
                batch[name] = torch.tensor(  # the cached scores, by their role's name
                    [e[f"{name}_0"] for e in examples] + [e[f"{name}_1"] for e in examples], dtype=torch.float32)
        return batch

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["seq_index"] >= 0).sum())
