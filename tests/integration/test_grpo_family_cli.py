"""The GRPO family's config values through the CLI on the micro model.

- DAPO's dynamic sampling under 2 processes (gloo): the random micro model never matches an answer, so every group's
  rewards agree; each iteration then draws 1 + max_sampling_rounds rounds (both ranks the same: their collectives
  would not pair up otherwise), consumes the fresh prompts (the epoch counter moves 3x as fast) and keeps its
  batch size, filled with zero-spread groups, all counted.
- CISPO with the overlong punishment: trains, and the punishment shows in the reward (random completions run
  to max_new_tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.data.synth import make_prompt_rows, write_rows
from tests.conftest import assert_ok, run_cli, write_config


def config(model: Path, prompts: Path, out: Path, **sections) -> dict:
    cfg = {"algorithm": "grpo", "output_dir": str(out), "model": {"name_or_path": str(model)},
           "data": {"train": str(prompts), "max_length": 48},
           "rollout": {"num_generations": 4, "max_new_tokens": 4},
           "reward": {"functions": [{"name": "exact_match", "weight": 1.0}]},
           "training": {"per_device_batch_size": 8, "learning_rate": 1e-4, "max_steps": 2},
           "logging": {"logging_steps": 1, "plot": False}}
    for name, value in sections.items():
        cfg.setdefault(name, {}).update(value)
    return cfg


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.slow(seconds=60)
def test_dynamic_sampling_two_ranks(micro_model: Path, tmp_path: Path) -> None:
    prompts = write_rows(make_prompt_rows(48, seed=0), tmp_path / "prompts.jsonl")
    cfg = config(micro_model, prompts, tmp_path / "run", grpo={"dynamic_sampling": True, "max_sampling_rounds": 2})
    assert_ok(run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))], nproc=2))
    logged = rows(tmp_path / "run")
    assert len(logged) == 2
    for r in logged:  # 2 ranks x 8 completions / 4 = 4 groups per round, no spread: 3 rounds, 12 dropped, 4 fill
        assert r["dynamic/generation_rounds"] == 3 and r["dynamic/groups_dropped"] == 12, r
        assert r["dynamic/groups_zero_std_kept"] == 4 and r["reward_mean"] == 0.0
    assert logged[0]["epoch"] == pytest.approx(12 / 48)  # 3 rounds x 4 prompts consumed by the first iteration


@pytest.mark.slow(seconds=40)
def test_cispo_with_the_overlong_punishment(micro_model: Path, tmp_path: Path) -> None:
    prompts = write_rows(make_prompt_rows(24, seed=0), tmp_path / "prompts.jsonl")
    cfg = config(micro_model, prompts, tmp_path / "run",
                 grpo={"objective": "cispo", "epsilon_high": 4.0, "overlong_buffer": 2, "overlong_penalty": 0.5})
    assert_ok(run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))]))
    logged = rows(tmp_path / "run")
    assert len(logged) == 2 and all(r["loss"] == r["loss"] for r in logged)
    # exact_match is 0; a completion of 3 tokens gets -0.25, of 4 (the limit) -0.5: the mean lies in [-0.5, 0)
    assert all(-0.5 <= r["reward_mean"] < 0.0 for r in logged), logged
