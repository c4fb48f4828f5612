"""grpo_agent across ranks (issue 48, C): the same trajectories (a scripted engine plays the agent, so they do not
depend on sampling: tests/plugins/scripted_agent_engine.py) on 1 process x 16 and on 2 gloo processes x 8 give the
same losses and gradient norms step by step (returns gathered in global order, the token_mean normaliser over every
rank) and the same agent metrics; and the metrics are what the script implies: half the trajectories call the
calculator then answer right (2 turns, reward 1), half guess wrong (1 turn, reward 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_cli, write_config

pytestmark = pytest.mark.distributed


def agent_run(micro_model: Path, out: Path, nproc: int, credit: str) -> list[dict]:
    cfg = {"algorithm": "grpo_agent", "output_dir": str(out), "plugins": ["tests.plugins.scripted_agent_engine"],
           "model": {"name_or_path": str(micro_model)},
           "data": {"train": "builtin:calculator_prompts_train.jsonl", "max_length": 200},
           "rollout": {"engine": "scripted_agent", "num_generations": 4, "max_new_tokens": 72},
           "agent": {"max_turns": 3, "max_total_tokens": 128, "credit": credit},
           "grpo": {"loss_aggregation": "token_mean"},
           "training": {"global_batch_size": 16, "per_device_batch_size": 16 // nproc, "max_steps": 3,
                        "learning_rate": 1e-3, "seed": 0},
           "logging": {"logging_steps": 1, "plot": False}, "checkpoint": {"save_final": False}}
    if nproc > 1:
        cfg["distributed"] = {"strategy": "ddp"}
    assert_ok(run_cli(["train", str(write_config(out.parent / f"{out.name}.yaml", cfg))], nproc=nproc, timeout=400))
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("credit", ["trajectory", "turn"])
def test_one_process_equals_two(micro_model: Path, tmp_path: Path, credit: str) -> None:
    one, two = (agent_run(micro_model, tmp_path / f"n{n}", n, credit) for n in (1, 2))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["grad_norm"] > 0
        for key in ("reward_mean", "agent/turns", "agent/tool_calls", "agent/tool_valid", "completion_length",
                    "agent/env_token_fraction", "advantage_std"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
        assert (a["reward_mean"], a["agent/turns"], a["agent/tool_calls"], a["agent/tool_valid"]) == (0.5, 1.5, 0.5, 1.0)
