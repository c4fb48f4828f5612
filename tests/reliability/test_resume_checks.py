"""A resume checks what it resumes (issue: a DPO run resumed an SFT checkpoint silently, and a changed
learning rate was ignored by the restored schedule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignkit.train.resume import compare
from tests.conftest import REPO, assert_ok, run_cli


def sft(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=64", "data.max_length=64", "training.per_device_batch_size=4",
            "training.max_steps=4", "training.lr_scheduler=constant", "training.warmup_steps=0",
            "training.learning_rate=1e-3", "logging.report_to=[jsonl]", "logging.logging_steps=1",
            "logging.plot=false", "checkpoint.save_steps=2", *extra]


def lrs(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


@pytest.fixture(scope="module")
def sft_run(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume_checks") / "sft"
    assert_ok(run_cli(sft(micro_model, out)))
    return out


def test_another_algorithm_is_refused_in_one_line(micro_model: Path, sft_run: Path, tmp_path: Path) -> None:
    proc = run_cli(["train", str(REPO / "configs" / "dpo.yaml"), f"model.name_or_path={micro_model}",
                    f"output_dir={tmp_path / 'dpo'}", f"checkpoint.resume_from={sft_run / 'checkpoint-2'}",
                    "training.max_steps=2", "data.max_length=64", "logging.report_to=[jsonl]", "logging.plot=false"])
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("alignkit: error: checkpoint.resume_from: ") and "was written by another run" in last
    assert "algorithm: 'sft' -> 'dpo'" in last and "resume_weights_only=true" in last and "Traceback" not in proc.stderr
    # said before the run starts (it came after the strategy's set-up and every model's load)
    assert "Strategy:" not in proc.stderr and "parameters" not in proc.stderr


def test_weights_only_starts_a_new_run_from_the_weights(micro_model: Path, sft_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "dpo"
    proc = run_cli(["train", str(REPO / "configs" / "dpo.yaml"), f"model.name_or_path={micro_model}",
                    f"output_dir={out}", f"checkpoint.resume_from={sft_run / 'checkpoint-2'}",
                    "checkpoint.resume_weights_only=true", "training.max_steps=2", "data.max_length=64",
                    "data.eval=[]", "training.per_device_batch_size=4", "logging.report_to=[jsonl]",
                    "logging.logging_steps=1", "logging.plot=false"])
    assert_ok(proc)
    assert "Started a new run from the weights of" in proc.stderr and "Resumed from" not in proc.stderr
    assert sorted(lrs(out)) == [1, 2]  # a new run: steps from 1, its own schedule


def test_changed_learning_rate_is_applied_at_the_resumed_step(micro_model: Path, sft_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    (out / "checkpoint-2").parent.mkdir(parents=True)
    import shutil

    shutil.copytree(sft_run / "checkpoint-2", out / "checkpoint-2")
    proc = run_cli(sft(micro_model, out, "training.learning_rate=2e-3", "checkpoint.resume_from=latest"))
    assert_ok(proc)
    assert "Resume with a changed setting, applied: training.learning_rate: 0.001 -> 0.002" in proc.stderr
    assert "LR schedule rebuilt from the new settings at step 2 (lr now 0.002)" in proc.stderr
    assert lrs(out) == {3: 2e-3, 4: 2e-3}


def test_compare_classifies_keys() -> None:
    old = {"algorithm": "sft", "model": {"name_or_path": "m", "lora": None, "gradient_checkpointing": False},
           "training": {"learning_rate": 1e-3, "seed": 1}, "logging": {"logging_steps": 1}, "dpo": {"beta": 0.1}}
    new = {"algorithm": "sft", "model": {"name_or_path": "m", "lora": {"r": 8}, "gradient_checkpointing": True},
           "training": {"learning_rate": 2e-3, "seed": 1, "nonfinite": "skip"}, "logging": {"logging_steps": 5},
           "dpo": {"beta": 0.2}}
    fixed, allowed = compare(old, new)
    assert fixed == ["model.lora: None -> {'r': 8}", "dpo.beta: 0.1 -> 0.2"]
    assert allowed == ["model.gradient_checkpointing: False -> True", "training.learning_rate: 0.001 -> 0.002",
                       "logging.logging_steps: 1 -> 5"]


def test_a_checkpoint_saved_before_reward_model_existed_compares_under_the_new_keys(tmp_path: Path) -> None:
    from alignkit.train.resume import saved_config

    old = {"algorithm": "reward_model", "reward": {"pair": "helpful", "reg_coeff": 0.001, "model_weight": 1.0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    saved = saved_config(tmp_path)
    assert saved == {"algorithm": "reward_model", "reward": {"model_weight": 1.0},
                     "reward_model": {"pair": "helpful", "reg_coeff": 0.001}}
    new = {"algorithm": "reward_model", "reward": {"model_weight": 1.0},
           "reward_model": {"pair": "helpful", "reg_coeff": 0.01}}
    assert compare(saved, new)[0] == ["reward_model.reg_coeff: 0.001 -> 0.01"]


def test_another_placement_or_algorithm_of_an_online_run_is_not_the_same_run() -> None:
    """A checkpoint of a ``rollout.placement: separate`` GRPO run resumed colocated, or as RLOO, or as grpo_agent,
    is refused (the keys listed in one line by the runner: measured by hand on the micro model, 'checkpoint.resume_from:
    ... was written by another run (algorithm: 'grpo' -> 'rloo'; rollout.placement: 'separate' -> 'colocated')').
    A guard, not a fix: the refusal already held; rollout.* is a registered section, so its keys are fixed."""
    from alignkit.config import load_config, to_dict

    grpo = REPO / "configs" / "grpo.yaml"
    saved = to_dict(load_config(grpo, ["rollout.placement=separate", "rollout.max_staleness=1"], notes=False))
    for over, want in ((["algorithm=rloo"], ["algorithm: 'grpo' -> 'rloo'"]),
                       ([], ["rollout.max_staleness: 1 -> 0", "rollout.placement: 'separate' -> 'colocated'"])):
        fixed, _ = compare(saved, to_dict(load_config(grpo, over, notes=False)))
        assert all(line in fixed for line in want), (over, fixed)
