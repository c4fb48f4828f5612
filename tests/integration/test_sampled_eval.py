"""Held-out evaluation at the rollout's sampling settings (``rollout.eval_samples``, issue 48 4a): beside the greedy
eval/* an online run logs eval/sampled_* over n sampled completions per eval prompt, drawn from seeds of their own.

- grpo on the micro model: the training rows are bit-identical with it on or off (its draws do not touch the
  training's), the greedy eval is unchanged, the sampled eval is the same in a second run of the same seed and is
  not the greedy one (temperature 1 on a random model: other words, another ``length`` reward);
- grpo_agent with the scripted engine (tests/plugins/scripted_agent_engine.py: the k-th copy of a question in one
  call uses the calculator when k is even, guesses wrong when odd): greedy trajectories all succeed in 2 turns;
  2 samples per question give success 0.5, 1.5 turns, validity 1.0 (the copies of a question are sampled
  together); and 2 gloo processes give what 1 gives (each rank its share of the prompts, sums over ranks), also
  for grpo on the micro model with an odd number of eval prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.data.synth import make_prompt_rows, write_rows
from tests.conftest import assert_ok, run_cli, write_config

EVAL_KEYS = ("eval/reward_mean", "eval/completion_length", "eval/sampled_reward_mean", "eval/sampled_completion_length")


def grpo_config(model: Path, tmp: Path, out: Path, eval_samples: int) -> Path:
    train = write_rows(make_prompt_rows(32, seed=0), tmp / "train.jsonl")
    held_out = write_rows(make_prompt_rows(5, seed=1), tmp / "eval.jsonl")  # odd: 3 + 2 over 2 ranks
    cfg = {"algorithm": "grpo", "output_dir": str(out), "model": {"name_or_path": str(model)},
           "data": {"train": str(train), "eval": str(held_out), "max_length": 48},
           "rollout": {"num_generations": 4, "max_new_tokens": 6, "temperature": 1.0, "eval_samples": eval_samples},
           "reward": {"functions": [{"name": "length", "weight": 1.0}]},
           "training": {"per_device_batch_size": 8, "learning_rate": 1e-3, "max_steps": 2, "eval_steps": 1, "seed": 3},
           "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl"]}, "checkpoint": {"save_final": False}}
    return write_config(tmp / f"{out.name}.yaml", cfg)


def logged(run: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows) of a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval/reward_mean" in r]


TRAIN_KEYS = ("loss", "grad_norm", "entropy", "reward_mean", "reward_std", "advantage_std", "completion_length", "step")


def train_numbers(rows: list[dict]) -> list[list[float]]:
    return [[r[k] for k in TRAIN_KEYS] for r in rows]


@pytest.mark.slow(seconds=60)
def test_sampled_eval_leaves_training_alone(micro_model: Path, tmp_path: Path) -> None:
    runs = {}
    for name, n in (("off", 0), ("on", 2), ("again", 2)):
        assert_ok(run_cli(["train", str(grpo_config(micro_model, tmp_path, tmp_path / name, n))]))
        runs[name] = logged(tmp_path / name)
    (train_off, eval_off), (train_on, eval_on), (_, eval_again) = runs["off"], runs["on"], runs["again"]
    assert len(train_on) == 2 and len(eval_on) == 3  # before, after step 1, at the end
    assert train_numbers(train_on) == train_numbers(train_off)  # bit-identical: loss, grad_norm, rewards, ...
    assert [r["eval/reward_mean"] for r in eval_on] == [r["eval/reward_mean"] for r in eval_off]
    assert all("eval/sampled_reward_mean" not in r for r in eval_off)
    assert [[r[k] for k in EVAL_KEYS] for r in eval_on] == [[r[k] for k in EVAL_KEYS] for r in eval_again]
    assert any(r["eval/sampled_reward_mean"] != r["eval/reward_mean"] for r in eval_on), eval_on  # it sampled


def agent_config(model: Path, tmp: Path, out: Path, nproc: int) -> Path:
    cfg = {"algorithm": "grpo_agent", "output_dir": str(out), "plugins": ["tests.plugins.scripted_agent_engine"],
           "model": {"name_or_path": str(model)},
           "data": {"train": "builtin:calculator_prompts_train.jsonl", "eval": "builtin:calculator_prompts_eval.jsonl",
                    "max_eval_examples": 5, "max_length": 200},
           "rollout": {"engine": "scripted_agent", "num_generations": 4, "max_new_tokens": 72, "eval_samples": 2},
           "agent": {"max_turns": 3, "max_total_tokens": 128},
           "training": {"global_batch_size": 8, "per_device_batch_size": 8 // nproc, "max_steps": 1,
                        "learning_rate": 1e-3, "seed": 0},
           "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl"]}, "checkpoint": {"save_final": False}}
    if nproc > 1:
        cfg["distributed"] = {"strategy": "ddp"}
    return write_config(tmp / f"{out.name}.yaml", cfg)


@pytest.mark.slow(seconds=60)
def test_agent_sampled_eval_metrics(micro_model: Path, tmp_path: Path) -> None:
    assert_ok(run_cli(["train", str(agent_config(micro_model, tmp_path, tmp_path / "n1", 1))]))
    _, evals = logged(tmp_path / "n1")
    assert len(evals) == 2
    for r in evals:
        assert (r["eval/reward_mean"], r["eval/turns"], r["eval/tool_valid"]) == (1.0, 2.0, 1.0)
        assert (r["eval/sampled_reward_mean"], r["eval/sampled_turns"], r["eval/sampled_tool_valid"]) == (0.5, 1.5, 1.0)


@pytest.mark.distributed
@pytest.mark.slow(seconds=120)
def test_two_processes_evaluate_as_one(micro_model: Path, tmp_path: Path) -> None:
    for n in (1, 2):
        assert_ok(run_cli(["train", str(agent_config(micro_model, tmp_path, tmp_path / f"agent{n}", n))],
                          nproc=n, timeout=400))
    a1, a2 = (logged(tmp_path / f"agent{n}")[1] for n in (1, 2))
    keys = (*EVAL_KEYS, "eval/turns", "eval/tool_valid", "eval/sampled_turns", "eval/sampled_tool_valid")
    assert [[r[k] for k in keys] for r in a1] == [[r[k] for k in keys] for r in a2]
    for n in (1, 2):
        cfg = grpo_config(micro_model, tmp_path, tmp_path / f"grpo{n}", 3)
        extra = ["distributed.strategy=ddp", "training.per_device_batch_size=4"] if n > 1 else []
        assert_ok(run_cli(["train", str(cfg), *extra], nproc=n, timeout=400))
    g1, g2 = (logged(tmp_path / f"grpo{n}")[1] for n in (1, 2))
    assert len(g1) == len(g2) == 3
    for r1, r2 in zip(g1, g2):
        for k in EVAL_KEYS:
            assert r1[k] == pytest.approx(r2[k], rel=1e-9), k
