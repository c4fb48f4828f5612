"""Unpaired rows (KTO) -> tokenized (prompt, completion, desirable) examples with a mismatched KL completion.

Row formats:

* TRL's unpaired format ``{"prompt", "completion", "label"}``: strings or message lists; ``label`` is
  true for a desirable completion, false for an undesirable one. A row without ``label`` is a one-line
  error naming its file and line.
* A preference pair (``prompt``/``chosen``/``rejected``, or PKU-SafeRLHF with ``pair``) becomes two
  examples, the chosen desirable and the rejected undesirable, as TRL's ``unpair_preference_dataset``.

An example is ``{input_ids, labels, prompt_len, label}``: labels are the ids on completion tokens and
IGNORE_INDEX on the prompt. Examples of a split are laid out as TRL's unpairing does: the first example
of every row (a chosen completion, or the row's only one), then the second of every paired row (its
rejected one). Then every example gets a KL sequence ``kl_input_ids`` / ``kl_labels``: its prompt with
the completion of the closest earlier example (cyclically) whose prompt differs, the mismatched pair
from which KTO estimates KL(pi || pi_ref) (TRL pairs each completion with the previous one of its batch).
The pairing is fixed per example, so z0 does not depend on the batch layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignkit.config.schema import DataConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch
from alignkit.data.collate import TokenCollator
from alignkit.data.io import TRUNCATED, DataError, Row, RowCounts, convert_rows
from alignkit.data.preference import _bool, as_chat, pair_from_row, text_or_messages, truncate_prompt_response
from alignkit.data.tokenize import encode_prompt_response

#: how far back to look for an example with another prompt (rows that share a prompt sit together)
_PARTNER_SEARCH = 64


def unpaired_from_row(row: Row, pair: str = "helpful") -> list[tuple[Any, Any, bool]]:
    """``[(prompt, completion, desirable)]`` of one row (module docstring); raises DataError naming file:line."""
    d = row.data
    if "completion" in d or "label" in d:
        if "label" not in d:
            raise DataError(f"{row.where()}: a KTO row needs a desirability label 'label' (true = desirable, "
                            f"false = undesirable) beside 'prompt' and 'completion' (row has {sorted(d)})")
        return [(text_or_messages(row, "prompt"), text_or_messages(row, "completion"), _bool(row, "label"))]
    if not any(k in d for k in ("chosen", "rejected", "response_0", "response_1", "response_2")):
        raise DataError(f"{row.where()}: a KTO row needs 'prompt'+'completion'+'label' (true = desirable) or a "
                        f"preference pair 'prompt'+'chosen'+'rejected' (row has {sorted(d)})")
    p = pair_from_row(row, pair)
    return [(p.prompt, p.chosen, True), (p.prompt, p.rejected, False)]


def encode_completion(tokenizer: Any, prompt: Any, completion: Any, row: Row, *, max_length: int,
                      chat_template: bool, memo: dict[str, list[int]]) -> dict[str, Any] | None:
    """One (prompt, completion) as ``{input_ids, labels, prompt_len}``; None when no completion token is left."""
    if chat_template:
        prompt, completion = as_chat(prompt, "user"), as_chat(completion, "assistant")
    ids, mask = encode_prompt_response(tokenizer, prompt, completion, row, memo)
    if len(ids) > max_length:
        ids, mask = truncate_prompt_response(ids, mask, max_length)
        row.note(TRUNCATED)
    if sum(mask[1:]) == 0:  # position 0 is never predicted
        return None
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)],
            "prompt_len": mask.index(1)}


@dataclass
class unpaired_converter:  # noqa: N801 - used as a function (picklable, as pair_converter)
    """``row -> [example, ...] or None`` (module docstring)."""

    tokenizer: Any
    max_length: int
    pair: str
    chat_template: bool

    def __call__(self, row: Row) -> list[dict[str, Any]] | None:
        memo: dict[str, list[int]] = {}  # the prompt's tokens serve both sides of a pair
        out = []
        for prompt, completion, desirable in unpaired_from_row(row, self.pair):
            ex = encode_completion(self.tokenizer, prompt, completion, row, max_length=self.max_length,
                                   chat_template=self.chat_template, memo=memo)
            if ex is not None:
                out.append({**ex, "label": desirable})
        return out or None


def attach_kl_completions(examples: list[dict[str, Any]], max_length: int) -> None:
    """Give every example its KL sequence: its prompt + the completion of the closest earlier example
    (cyclically, at most ``_PARTNER_SEARCH`` back) whose prompt tokens differ (module docstring)."""
    n = len(examples)
    for i, e in enumerate(examples):
        prompt = _prompt(e)
        back = range(1, min(n, _PARTNER_SEARCH + 1))
        o = examples[next(((i - b) % n for b in back if _prompt(examples[(i - b) % n]) != prompt), (i - 1) % n)]
        ids = prompt + o["input_ids"][o["prompt_len"]:]
        mask = [0] * len(prompt) + [int(t != IGNORE_INDEX) for t in o["labels"][o["prompt_len"]:]]
        ids, mask = truncate_prompt_response(ids, mask, max_length)
        e["kl_input_ids"], e["kl_labels"] = ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _prompt(e: dict[str, Any]) -> list[int]:
    return e["input_ids"][: e["prompt_len"]]


@dataclass
class UnpairedCollator:
    """B examples -> one padding-free packed row of their completions (``input_ids``, ``targets``,
    ``seq_index``, ``response_lengths``), ``desirable`` ``(B,)`` bool, and their B KL sequences packed the
    same way under the fields ``kl.<key>`` (model inputs under ``kl_in.<key>``; :func:`kl_batch`), with the
    KL targets' flat positions computed here, on the host; ``ref_logps`` / ``kl.ref_logps`` ``(B,)`` when every
    example carries cached reference log-probs."""

    pad_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        pack = TokenCollator(self.pad_token_id, packed=True)
        batch = pack([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
        batch["response_lengths"] = _lengths([e["labels"] for e in examples])
        batch["desirable"] = torch.tensor([bool(e["label"]) for e in examples])
        if all("ref_logps" in e for e in examples):  # kto.precompute_ref_logps
            batch["ref_logps"] = torch.tensor([e["ref_logps"] for e in examples], dtype=torch.float32)
            batch["kl.ref_logps"] = torch.tensor([e["ref_kl_logps"] for e in examples], dtype=torch.float32)
        kl = pack([{"input_ids": e["kl_input_ids"], "labels": e["kl_labels"]} for e in examples])
        kl["response_lengths"] = _lengths([e["kl_labels"] for e in examples])
        kl["target_index"] = (kl["targets"].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        for k, v in kl.items():
            batch[f"kl_in.{k}" if k in kl.input_keys else f"kl.{k}"] = v
        return batch


def _lengths(labels: list[list[int]]) -> torch.Tensor:
    # one token fewer than labels: position 0 is never a target (targets are shifted)
    return torch.tensor([sum(t != IGNORE_INDEX for t in lab[1:]) for lab in labels])


def kl_batch(batch: Any) -> Any:
    """The KL sequences of a collated batch as a batch of their own (inputs and fields split again)."""
    return Batch({k[len("kl_in."):]: v for k, v in batch.items() if k.startswith("kl_in.")},
                 {k[len("kl."):]: v for k, v in batch.items() if k.startswith("kl.")})


class UnpairedData:
    """The KTO pipeline: rows -> examples in memory on every rank (the KL pairing needs the whole split;
    the Arrow cache holds one example per row), loss unit = one completion."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, pair: str = "helpful") -> None:
        self.tokenizer, self.cfg, self.pair = tokenizer, cfg, pair
        self.skipped: dict[str, int] = {}
        self.row_counts: dict[str, RowCounts] = {}
        #: per split, (desirable, undesirable) completions of the whole split, counted once as it is built
        self.label_counts: dict[str, tuple[int, int]] = {}

    def build_dataset(self, specs: list[str], split: str) -> list[dict[str, Any]]:
        d = self.cfg
        convert = unpaired_converter(self.tokenizer, d.max_length, self.pair, d.chat_template)
        limit = d.max_train_examples if split == "train" else d.max_eval_examples
        rows, counts = convert_rows(specs, convert, skip_invalid=d.skip_invalid, limit=limit)
        examples = [r[0] for r in rows] + [r[1] for r in rows if len(r) > 1]  # TRL's unpairing order
        attach_kl_completions(examples, d.max_length)
        self.row_counts[split], self.skipped[split] = counts, counts.total_dropped
        n_d = sum(bool(e["label"]) for e in examples)
        self.label_counts[split] = (n_d, len(examples) - n_d)
        if split == "train" and examples and n_d in (0, len(examples)):
            kind, other = ("desirable", "undesirable") if n_d else ("undesirable", "desirable")
            raise DataError(f"data.train: all {len(examples)} completions are {kind} (label "
                            f"{str(bool(n_d)).lower()}); KTO needs {other} ones too (label {str(not n_d).lower()}), "
                            "else their loss and metrics are undefined (NaN)")
        return examples

    def collate(self, examples: list[dict[str, Any]]) -> Any:
        return UnpairedCollator(self.tokenizer.pad_token_id)(examples)

    def loss_units(self, batch: Any) -> int:
        return int(batch["desirable"].shape[0])

    def tokens_in(self, batch: Any) -> int:
        return int((batch["seq_index"] >= 0).sum()) + int((batch["kl.seq_index"] >= 0).sum())
