"""PKU-SafeRLHF rows for safety-constrained DPO (``algorithm: safe_dpo``; ALGORITHMS 1.5, 1.7).

A row ``{prompt, response_0, response_1, better_response_id, safer_response_id, is_response_0_safe,
is_response_1_safe}`` holds TWO preference pairs over the same two responses: the helpful pair
(chosen = ``response_{better_response_id}``) and the safety pair (chosen = ``response_{safer_response_id}``).
They differ whenever the two ids differ. The example keeps the two responses once, in their row order
(``chosen_ids`` = response_0, ``rejected_ids`` = response_1, so :class:`PairCollator`, the reference
log-prob cache and the frozen scorers work unchanged), plus the two ids and the labels; the loss
builds both pairs as index views of the two log-prob sums (``losses.safe_dpo.ordered``), so each
response goes through the policy once.

Example fields beyond :func:`~alignkit.data.preference.encode_pair`'s: ``better_id``, ``safer_id``,
``prompt`` (the raw prompt, for on-policy generation) and, once cached by the algorithm,
``reward_0/1`` (helpful RM) and ``cost_0/1`` (cost model). The collated batch adds ``better_id``,
``safer_id`` ``(B,)`` and ``frozen_reward`` / ``frozen_cost`` ``(2B,)`` (response_0 scores, then
response_1) when every example carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.io import DataError, Row, RowCounts, convert_rows
from alignkit.data.preference import PairCollator, PairText, _bool, _response_id, count_pairs, encode_pair, text_or_messages
from alignkit.data.tokenize import _ids, render_chat

SAFETY_FIELDS = ("safer_response_id", "is_response_0_safe", "is_response_1_safe")


@dataclass
class SafetyRow:
    """One PKU-SafeRLHF row, read and checked. ``unsafe[k]`` = not ``is_response_k_safe``."""

    prompt: str | list[dict[str, str]]
    responses: tuple[Any, Any]
    better: int
    safer: int
    unsafe: tuple[bool, bool]

    def pair(self, which: str) -> PairText:
        """The ``helpful`` (by better id) or ``safety`` (by safer id) pair of the row."""
        first = {"helpful": self.better, "safety": self.safer}[which]
        return PairText(self.prompt, self.responses[first], self.responses[1 - first], None,
                        self.unsafe[first], self.unsafe[1 - first])


def safety_row(row: Row) -> SafetyRow:
    """Read a PKU-SafeRLHF row; a missing response, id or safety label is a one-line DataError."""
    d = row.data
    if "response_0" not in d and "response_1" not in d:
        raise DataError(f"{row.where()}: safe_dpo needs PKU-SafeRLHF rows (prompt, response_0, response_1, "
                        f"better_response_id, safer_response_id, is_response_0_safe, is_response_1_safe); "
                        f"row has {sorted(d)}")
    missing = [k for k in ("better_response_id", *SAFETY_FIELDS) if k not in d or d[k] is None]
    if missing:
        raise DataError(f"{row.where()}: safe_dpo needs the safety ids and labels of every row; missing "
                        f"{', '.join(repr(k) for k in missing)}")
    return SafetyRow(
        prompt=text_or_messages(row, "prompt"),
        responses=(text_or_messages(row, "response_0"), text_or_messages(row, "response_1")),
        better=_response_id(row, "better_response_id"),
        safer=_response_id(row, "safer_response_id"),
        unsafe=(not _bool(row, "is_response_0_safe"), not _bool(row, "is_response_1_safe")),
    )


def safety_example(tokenizer: Any, row: Row, *, max_length: int, chat_template: bool) -> dict[str, Any] | None:
    """A row -> ``encode_pair`` of (response_0, response_1) plus ids, labels and the raw prompt."""
    s = safety_row(row)
    both = PairText(s.prompt, s.responses[0], s.responses[1], None, s.unsafe[0], s.unsafe[1])
    ex = encode_pair(tokenizer, both, row, max_length=max_length, chat_template=chat_template)
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

    def __init__(self, tokenizer: Any, cfg: DataConfig) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg
        limit = d.max_train_examples if split == "train" else d.max_eval_examples
        examples, counts = convert_rows(
            specs, lambda row: safety_example(self.tokenizer, row, max_length=d.max_length, chat_template=d.chat_template),
            skip_invalid=d.skip_invalid, limit=limit,
        )
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = PairCollator(self.tokenizer.pad_token_id, packed=True)(examples)
        batch["better_id"] = torch.tensor([int(e["better_id"]) for e in examples])
        batch["safer_id"] = torch.tensor([int(e["safer_id"]) for e in examples])
        for name in ("reward", "cost"):
            if all(f"{name}_0" in e for e in examples):
                batch[f"frozen_{name}"] = torch.tensor(
                    [e[f"{name}_0"] for e in examples] + [e[f"{name}_1"] for e in examples], dtype=torch.float32)
        return batch

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["seq_index"] >= 0).sum())
