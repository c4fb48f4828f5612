"""PKU-SafeRLHF rows for safe_dpo: two pairs per row, one-line errors, the collated batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.config.schema import DataConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import PACKED_KEYS
from alignkit.data.io import DataError, Row
from alignkit.data.safety import SafetyData, prompt_ids, safety_row
from alignkit.models.policy import model_inputs

ROW = {
    "prompt": "How do I spy on my neighbours?",
    "response_0": "Bring binoculars and hide behind the hedge.",
    "response_1": "I can't help with that; it would hurt their privacy.",
    "better_response_id": 0,
    "safer_response_id": 1,
    "is_response_0_safe": False,
    "is_response_1_safe": True,
}


@pytest.fixture(scope="module")
def tok(micro_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_the_two_pairs_differ_when_better_is_not_safer() -> None:
    s = safety_row(Row(ROW, "f.jsonl", 1))
    helpful, safety = s.pair("helpful"), s.pair("safety")
    assert (helpful.chosen, helpful.rejected) == (ROW["response_0"], ROW["response_1"])
    assert (safety.chosen, safety.rejected) == (ROW["response_1"], ROW["response_0"])
    assert (helpful.chosen_unsafe, safety.chosen_unsafe) == (True, False)
    same = safety_row(Row({**ROW, "safer_response_id": 0}, "f.jsonl", 1))
    assert same.pair("helpful") == same.pair("safety")


@pytest.mark.parametrize("drop", ["safer_response_id", "is_response_1_safe", "better_response_id"])
def test_a_row_without_safety_ids_or_labels_is_one_line(drop: str) -> None:
    row = {k: v for k, v in ROW.items() if k != drop}
    with pytest.raises(DataError) as e:
        safety_row(Row(row, "data/pku.jsonl", 7))
    msg = str(e.value)
    assert "data/pku.jsonl:7" in msg and drop in msg and "\n" not in msg


def test_chosen_rejected_rows_are_refused() -> None:
    with pytest.raises(DataError, match="PKU-SafeRLHF rows"):
        safety_row(Row({"prompt": "p", "chosen": "a", "rejected": "b"}, "f.jsonl", 2))


def test_examples_and_batch(tok, tmp_path: Path) -> None:
    rows = [ROW, {**ROW, "better_response_id": 1, "safer_response_id": 1, "is_response_0_safe": True}]
    data = SafetyData(tok, DataConfig(max_length=128))
    ex = data.build_dataset([write_jsonl(tmp_path / "pku.jsonl", rows)], "train")
    assert len(ex) == 2 and ex[0]["better_id"] == 0 and ex[0]["safer_id"] == 1
    # response_0 and response_1 in row order, each once
    prefix = prompt_ids(tok, ROW["prompt"], chat_template=False)
    assert ex[0]["chosen_ids"][: len(prefix)] == prefix
    assert all(t == IGNORE_INDEX for t in ex[0]["chosen_labels"][: len(prefix)])
    assert ex[0]["chosen_labels"][len(prefix)] != IGNORE_INDEX
    assert (ex[0]["chosen_unsafe"], ex[0]["rejected_unsafe"]) == (True, False)
    for e in ex:
        e.update(reward_0=1.0, reward_1=2.0, cost_0=0.5, cost_1=-0.5)
    batch = data.collate(ex)
    assert batch["better_id"].tolist() == [0, 1] and batch["safer_id"].tolist() == [1, 1]
    assert batch["reward"].tolist() == [1.0, 1.0, 2.0, 2.0]  # cached scores, read back by their own names
    assert batch["cost"].tolist() == [0.5, 0.5, -0.5, -0.5]
    assert data.loss_units(batch) == 2
    # nothing else reaches the forward: the packed row and its host-side boundaries (data.collate.PACKED_KEYS)
    assert set(model_inputs(batch)) == {"input_ids", "position_ids", *PACKED_KEYS}


def test_chat_prompt_ids_match_training(tok) -> None:
    from alignkit.data.tokenize import encode_prompt_response

    ids, mask = encode_prompt_response(tok, [{"role": "user", "content": "hi"}], "ok", Row({}, "f", 1))
    prefix = prompt_ids(tok, "hi", chat_template=True)
    assert ids[: len(prefix)] == prefix and mask.index(1) == len(prefix)
