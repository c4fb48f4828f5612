"""Frozen scorers for safe_dpo tests: a helpful RM and a cost model made from the micro LM.

Their heads are random (no training), which is all a mechanics test needs; the cost model's head
sign is chosen so that labelled-unsafe responses of the shipped safety rows cost more on average
than safe ones (the C > 0 = unsafe convention the sign check asks for), and ``flip=True`` gives
the opposite convention.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignkit.config.schema import DataConfig
from alignkit.data.safety import SafetyData
from alignkit.models.policy import forward_scores
from alignkit.models.scalar import ScalarHeadModel

ROWS = 64


def _save(model, tok, out: Path) -> Path:
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def make_scorers(micro_model: Path, out: Path, *, flip: bool = False) -> tuple[Path, Path]:
    """(helpful RM dir, cost model dir) under ``out``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro_model)
    torch.manual_seed(11)
    helpful = AutoModelForSequenceClassification.from_pretrained(micro_model, num_labels=1)
    helpful.config.pad_token_id = tok.pad_token_id
    torch.manual_seed(12)
    cost = AutoModelForSequenceClassification.from_pretrained(micro_model, num_labels=1)
    cost.config.pad_token_id = tok.pad_token_id
    data = SafetyData(tok, DataConfig(max_length=96))
    ex = data.build_dataset(["builtin:safety_train.jsonl"], "train")[:ROWS]
    batch = data.collate(ex)
    with torch.no_grad():
        c = forward_scores(ScalarHeadModel(cost), batch)
    unsafe = torch.cat([batch["chosen_unsafe"], batch["rejected_unsafe"]])
    diff = c[unsafe].mean() - c[~unsafe].mean()
    if (diff < 0) != flip:
        with torch.no_grad():
            cost.score.weight.neg_()
    return _save(helpful, tok, out / "helpful_rm"), _save(cost, tok, out / "harmless_rm")
