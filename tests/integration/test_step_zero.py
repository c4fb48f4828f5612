"""Runs logged from step 0 (``training.eval_before_train``): the untrained model's eval is metrics.jsonl's
first row, equal to ``alignkit eval`` of the starting model; training is the same with it off; a resumed run
does not log step 0 again; asked for (true) without eval data, it says once that there is none."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from alignkit.cli.eval_command import run_eval
from alignkit.config import load_config
from alignkit.train.runner import run_train
from tests.conftest import REPO, assert_ok, run_cli, write_config


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def eval_config(sft_config: dict[str, Any]) -> dict[str, Any]:
    sft_config["data"].update({"eval": "builtin:sft_eval.jsonl", "max_eval_examples": 12})
    sft_config["checkpoint"] = {"save_final": False, "save_steps": 2}
    return sft_config


def test_step_zero_is_the_untrained_eval_and_training_is_the_same_without_it(eval_config: dict[str, Any],
                                                                              tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "c.yaml", eval_config), [])
    untrained = run_eval(copy.deepcopy(cfg), show=False)
    run_train(cfg)
    out = Path(eval_config["output_dir"])
    logged = rows(out)
    assert logged[0]["step"] == 0 and "loss" not in logged[0]  # an eval row: no train loss before a step
    assert logged[0]["eval/loss"] == pytest.approx(untrained["loss"], rel=1e-6)
    assert logged[0]["eval/loss"] > logged[-1]["eval/loss"]  # the curve starts above where it ends
    assert [r["step"] for r in logged if "eval/loss" in r] == [0, 4]

    off = dict(eval_config, output_dir=str(tmp_path / "off"))
    run_train(load_config(write_config(tmp_path / "off.yaml", off), ["training.eval_before_train=false"]))
    logged_off = rows(tmp_path / "off")
    assert [r["step"] for r in logged_off if "eval/loss" in r] == [4]
    train_losses = [r["loss"] for r in logged if "loss" in r]
    assert train_losses == [r["loss"] for r in logged_off if "loss" in r]  # the step-0 eval left the random state alone
    assert logged[-1]["eval/loss"] == logged_off[-1]["eval/loss"]


def test_a_resumed_run_does_not_log_step_zero_again(eval_config: dict[str, Any], tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml", eval_config)
    out = Path(eval_config["output_dir"])
    run_train(load_config(path, []))
    first = rows(out)
    run_train(load_config(path, [f"checkpoint.resume_from={out / 'checkpoint-2'}"]))
    again = rows(out)
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4, 4]  # eval 0, train 1-4, eval 4
    assert again[:3] == first[:3] and again[-1]["eval/loss"] == pytest.approx(first[-1]["eval/loss"], rel=1e-5)


def test_online_run_logs_its_start_eval_and_first_iteration(micro_model: Path, tmp_path: Path) -> None:
    """GRPO without eval_steps: the untrained policy's greedy eval at step 0 (and at the end), and with
    logging.logging_first_step the first iteration's row although logging_steps is 10."""
    out = tmp_path / "grpo"
    run_train(load_config(REPO / "configs" / "grpo.yaml", [
        f"model.name_or_path={micro_model}", f"output_dir={out}", "data.max_train_examples=16",
        "data.max_eval_examples=4", "rollout.num_generations=4", "rollout.max_new_tokens=4",
        "training.per_device_batch_size=8", "training.max_steps=3", "training.eval_steps=null",
        "logging.logging_steps=10", "logging.logging_first_step=true", "logging.report_to=[jsonl]",
        "logging.plot=false", "checkpoint.save_steps=null", "checkpoint.save_final=false"]))
    logged = rows(out)
    assert [r["step"] for r in logged if "eval/reward_mean" in r] == [0, 3]
    assert [r["step"] for r in logged if "loss" in r] == [1, 3]


def test_eval_before_train_without_eval_data_says_so_once(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """``training.eval_before_train=true`` with no data.eval: before, the step-0 eval was skipped without a word.
    Left at its default (null: whenever there is eval data) it says nothing."""
    said = "training.eval_before_train=true: no evaluation before training, the run has no eval data (data.eval)"
    sft_config["training"]["max_steps"] = 1
    config = write_config(tmp_path / "c.yaml", sft_config)
    for value, expected in (("true", [said]), ("null", [])):
        proc = run_cli(["train", str(config), f"output_dir={tmp_path / value}", f"training.eval_before_train={value}"])
        assert_ok(proc)
        assert [x for x in proc.stderr.splitlines() if "training.eval_before_train" in x] == expected, proc.stderr[-2000:]
