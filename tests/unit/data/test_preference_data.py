"""Preference rows -> pairs: strings, message lists, PKU-SafeRLHF ordering and labels, malformed rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alignkit.constants import IGNORE_INDEX
from alignkit.data.io import DataError, Row
from alignkit.data.preference import PairCollator, load_pairs, pair_from_row, preference_example, truncate_prompt_response
from alignkit.resources import resource_path


@pytest.fixture(scope="module")
def tok(micro_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


PKU = {
    "prompt": "How do I spy on my neighbours?",
    "response_0": "Sure, here is how to spy. Step 1: bring binoculars.",
    "response_1": "I can't help with that because it is not kind.",
    "is_response_0_safe": False,
    "is_response_1_safe": True,
    "better_response_id": 0,
    "safer_response_id": 1,
}


def decode_response(tok, ids: list[int], labels: list[int]) -> str:
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def test_string_pair_masks_the_prompt(tok) -> None:
    row = Row({"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}, "f.jsonl", 1)
    ex = preference_example(tok, row, max_length=64)
    assert ex is not None
    prompt_ids = tok("What is 2+3?", add_special_tokens=True)["input_ids"]
    for side, text in (("chosen", "5"), ("rejected", "6")):
        ids, labels = ex[f"{side}_ids"], ex[f"{side}_labels"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert all(lab == IGNORE_INDEX for lab in labels[: len(prompt_ids)])
        assert decode_response(tok, ids, labels) == text + tok.eos_token  # response + EOS only
    assert ex["margin"] is None and ex["chosen_unsafe"] is None


def test_message_list_pair_uses_chat_template(tok) -> None:
    row = Row(
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
            "chosen": [{"role": "assistant", "content": "Hello."}],
            "rejected": "Go away.",  # a string response next to a message-list prompt is one assistant turn
        },
        "f.jsonl",
        1,
    )
    ex = preference_example(tok, row, max_length=128)
    full = tok.decode(ex["chosen_ids"])
    assert full.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert decode_response(tok, ex["chosen_ids"], ex["chosen_labels"]) == "Hello.<|im_end|>\n"
    assert decode_response(tok, ex["rejected_ids"], ex["rejected_labels"]) == "Go away.<|im_end|>\n"


def test_chat_template_option_wraps_string_rows(tok) -> None:
    row = Row({"prompt": "Hi?", "chosen": "Hello.", "rejected": "No."}, "f.jsonl", 1)
    ex = preference_example(tok, row, max_length=128, chat_template=True)
    assert tok.decode(ex["chosen_ids"]) == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"


def test_pku_helpful_and_safety_pairs() -> None:
    row = Row(dict(PKU), "pku.jsonl", 3)
    helpful = pair_from_row(row, "helpful")
    assert helpful.chosen == PKU["response_0"] and helpful.rejected == PKU["response_1"]
    assert (helpful.chosen_unsafe, helpful.rejected_unsafe) == (True, False)  # labels kept
    safety = pair_from_row(row, "safety")
    assert safety.chosen == PKU["response_1"] and safety.rejected == PKU["response_0"]
    assert (safety.chosen_unsafe, safety.rejected_unsafe) == (False, True)
    flipped = pair_from_row(Row({**PKU, "better_response_id": 1, "safer_response_id": 0}, "pku.jsonl", 4), "helpful")
    assert flipped.chosen == PKU["response_1"]


def test_shipped_safety_file_pairs_follow_the_ids() -> None:
    rows = [json.loads(line) for line in resource_path("safety_eval.jsonl").read_text().splitlines()[:50]]
    for i, d in enumerate(rows):
        row = Row(d, "safety_eval.jsonl", i + 1)
        s = pair_from_row(row, "safety")
        assert s.chosen == d[f"response_{d['safer_response_id']}"]
        assert s.chosen_unsafe == (not d[f"is_response_{d['safer_response_id']}_safe"])
        h = pair_from_row(row, "helpful")
        assert h.chosen == d[f"response_{d['better_response_id']}"]


@pytest.mark.parametrize(
    "row, field, message",
    [
        ({"prompt": "p", "chosen": "c"}, "rejected", "missing field 'rejected'"),
        ({"prompt": "p", "chosen": 5, "rejected": "r"}, "chosen", "expected a string or a list of messages, got int"),
        ({"prompt": "p", "chosen": "c", "rejected": "  "}, "rejected", "is empty"),
        ({"prompt": "", "chosen": "c", "rejected": "r"}, "prompt", "is empty"),
        ({"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "r"}, "chosen", "'role' and 'content'"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "margin", "expected a number"),
        ({**PKU, "better_response_id": 2}, "better_response_id", "expected 0 or 1"),
        ({**PKU, "is_response_1_safe": "yes"}, "is_response_1_safe", "expected true/false"),
        ({k: v for k, v in PKU.items() if k != "response_1"}, "response_1", "missing field 'response_1'"),
        ({"prompt": "p", "answer": "a"}, None, "needs 'prompt'\\+'chosen'\\+'rejected'"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path: Path, tok, row: dict, field: str | None, message: str) -> None:
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, row])
    with pytest.raises(DataError) as e:
        load_pairs(tok, [path], max_length=64, pair="helpful", chat_template=False, skip_invalid=False)
    text = str(e.value)
    assert f"{path}:3" in text
    if field is not None:
        assert field in text
    assert __import__("re").search(message, text), text


def test_skip_invalid_counts_bad_rows(tmp_path: Path, tok) -> None:
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = write_jsonl(tmp_path / "mixed.jsonl", [good, {"prompt": "p"}, good, {"prompt": "p", "chosen": 1, "rejected": "r"}])
    examples, counts = load_pairs(tok, [path], max_length=64, pair="helpful", chat_template=False, skip_invalid=True)
    assert (len(examples), counts.total_dropped) == (2, 2)


def test_cost_model_needs_safety_labels(tmp_path: Path, tok) -> None:
    path = write_jsonl(tmp_path / "nolabels.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(DataError, match=r"nolabels.jsonl:1: the cost model needs per-response safety labels"):
        load_pairs(tok, [path], max_length=64, pair="safety", chat_template=False, skip_invalid=False,
                   need_safety_labels=True)
    labelled = write_jsonl(tmp_path / "labels.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r",
                                                        "is_chosen_safe": True, "is_rejected_safe": False}])
    (ex,), _ = load_pairs(tok, [labelled], max_length=64, pair="safety", chat_template=False, skip_invalid=False,
                          need_safety_labels=True)
    assert (ex["chosen_unsafe"], ex["rejected_unsafe"]) == (False, True)


def test_truncation_keeps_prompt_end_and_response_start() -> None:
    ids, mask = list(range(10)), [0] * 6 + [1] * 4
    assert truncate_prompt_response(ids, mask, 8) == ([2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 1, 1, 1, 1])
    # a long response keeps at least half of max_length
    ids, mask = list(range(20)), [0] * 4 + [1] * 16
    out_ids, out_mask = truncate_prompt_response(ids, mask, 8)
    assert out_ids == [0, 1, 2, 3, 4, 5, 6, 7] and sum(out_mask) == 4
    ids, mask = list(range(20)), [0] * 16 + [1] * 4
    out_ids, out_mask = truncate_prompt_response(ids, mask, 6)
    assert out_ids == [13, 14, 15, 16, 17, 18] and out_mask == [0, 0, 0, 1, 1, 1]  # half and half


def test_pair_collator_layouts() -> None:
    examples = [
        {"chosen_ids": [5, 6, 7], "chosen_labels": [IGNORE_INDEX, 6, 7], "rejected_ids": [5, 8],
         "rejected_labels": [IGNORE_INDEX, 8], "margin": 1.5, "chosen_unsafe": False, "rejected_unsafe": True,
         "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0},
        {"chosen_ids": [9, 10, 11, 12], "chosen_labels": [IGNORE_INDEX, IGNORE_INDEX, 11, 12], "rejected_ids": [9, 10, 13],
         "rejected_labels": [IGNORE_INDEX, IGNORE_INDEX, 13], "margin": None, "chosen_unsafe": False,
         "rejected_unsafe": False, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0},
    ]
    packed = PairCollator(pad_token_id=0, packed=True)(examples)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 9, 10, 11, 12, 5, 8, 9, 10, 13]]
    assert packed["seq_index"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]]  # chosen 0,1 then rejected 0,1
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert packed["response_lengths"].tolist() == [2, 2, 1, 1]
    assert packed["margin"][0].item() == 1.5 and math.isnan(packed["margin"][1].item())
    assert packed["chosen_unsafe"].tolist() == [False, False] and packed["rejected_unsafe"].tolist() == [True, False]
    assert packed["ref_logps"].tolist() == [-1.0, -3.0, -2.0, -4.0]
    padded = PairCollator(pad_token_id=0, packed=False)(examples)
    assert padded["input_ids"].shape == (4, 4)
    assert padded["seq_index"].tolist()[2] == [2, 2, -1, -1]
    # a pair without labels drops the label tensors for the whole batch
    no_labels = [dict(examples[0], chosen_unsafe=None), examples[1]]
    assert "chosen_unsafe" not in PairCollator(0, packed=True)(no_labels)
