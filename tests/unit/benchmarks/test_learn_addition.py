"""benchmarks/learn_addition.py: the pure pieces (the addition task's rows and split, the best constant answer,
the t intervals and the paired differences), on hand-computed cases; no learning run."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import learn_addition as la


def test_rows_answer_the_sum() -> None:
    assert la.row(37, 48) == {"prompt": "What is 37+48?", "answer": "85"}
    assert la.row(99, 99)["answer"] == "198"
    for q, answer in la.held_out_rows():
        a, b = map(int, re.fullmatch(r"What is (\d\d)\+(\d\d)\?", q).groups())
        assert answer == str(a + b)


def test_held_out_pairs_are_fixed_and_never_trained_on(tmp_path: Path) -> None:
    held, train = la.addition_pairs()
    assert len(held) == la.HELD_OUT and len(held) + len(train) == 90 * 90
    assert not set(held) & set(train)
    assert la.addition_pairs()[0] == held  # the same draw on every call
    paths = la.write_task_data(tmp_path, sft_rows=300)
    held_q = {q for q, _ in la.held_out_rows()}
    prompts = [json.loads(x) for x in Path(paths["prompts"]).read_text().splitlines()]
    sft = [json.loads(x)["messages"] for x in Path(paths["sft"]).read_text().splitlines()]
    assert len(prompts) == la.TRAIN_PROMPTS and len(sft) == 300
    assert not {r["prompt"] for r in prompts} & held_q and not {m[0]["content"] for m in sft} & held_q
    for m in sft:  # SFT rows: the bare sum
        a, b = map(int, re.findall(r"\d\d", m[0]["content"]))
        assert m[1]["content"] == str(a + b)


def test_constant_policy_scores_the_most_common_answer() -> None:
    rows = [("q1", "5"), ("q2", "7"), ("q3", "5"), ("q4", "9")]
    assert la.constant_policy(rows) == {"answer": "5", "accuracy": 0.5}
    assert la.constant_policy(la.held_out_rows())["accuracy"] < 0.05  # a constant answer scores ~0 here


def test_t_interval_on_hand_numbers() -> None:
    ci = la.t_interval([1.0, 2.0, 3.0, 4.0])  # sd sqrt(5/3), se sd/2, t(3) 3.182
    assert ci["mean"] == 2.5 and ci["se"] == pytest.approx(math.sqrt(5 / 3) / 2)
    assert ci["ci95"] == pytest.approx(3.182 * 0.6454972, rel=1e-6)
    assert ci["lo"] == pytest.approx(2.5 - 2.0539721, rel=1e-6) and ci["n"] == 4
    wide = la.t_interval([0.0, 1.0] * 20)  # df 39 > 30: the normal 1.96; sd sqrt(10 / 39), se sd / sqrt(40)
    assert wide["ci95"] == pytest.approx(1.96 * math.sqrt(10 / 39) / math.sqrt(40))


def test_paired_differences_on_hand_numbers() -> None:
    p = la.paired([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])  # diffs 0.1, 0, 0.2: sd 0.1, se 0.1/sqrt(3), t(2) 4.303
    assert p["mean"] == pytest.approx(0.1) and p["ci95"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert (p["higher"], p["lower"]) == (1 + 1, 0)
    with pytest.raises(ValueError):
        la.paired([0.1, 0.2], [0.1])  # unpaired seeds are refused
