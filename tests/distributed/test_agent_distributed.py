"""grpo_agent across ranks (issue 48, C): the same trajectories (a scripted engine plays the agent, so they do not
depend on sampling: tests/plugins/scripted_agent_engine.py) on 1 process x 16 and on 2 gloo processes x 8 give the
same losses and gradient norms step by step (returns gathered in global order, the token_mean normaliser over every
rank) and the same agent metrics; and the metrics are what the script implies: half the trajectories call the
calculator then answer right (2 turns, reward 1), half guess wrong (1 turn, reward 0). ``ppo_agent`` likewise, with its
critic's statistics and weights, and every rank's iteration statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, child_env, run_cli, write_config
from tests.distributed.runs import max_delta
from tests.integration.test_agent_cli import ppo_config

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


@pytest.mark.slow(seconds=60)
def test_ppo_agent_one_process_equals_two(micro_model: Path, tmp_path: Path) -> None:
    """``ppo_agent`` across ranks (issue 48): 1 process x 8 trajectories == 2 gloo processes x 4 (DDP) on the same
    global batch, step by step: the losses (policy and value), gradient norm, kl, the raw advantage std (one
    all-reduce over every rank's policy ids), the reward and agent statistics, and the final policy and value weights
    (float tolerance); and every rank of the 2-process run computed the same iteration statistics (each writes its
    own: tests/plugins/rank_stats.py), equal to the 1-process run's."""
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        cfg = ppo_config(micro_model, out)
        cfg["plugins"] = [*cfg["plugins"], "tests.plugins.rank_stats"]
        cfg["training"] = {**cfg["training"], "global_batch_size": 8, "per_device_batch_size": 8 // n}
        cfg["checkpoint"] = {"save_final": True}
        if n > 1:
            cfg["distributed"] = {"strategy": "ddp"}
        (tmp_path / f"ranks{n}").mkdir()
        env = child_env(ALIGNKIT_TEST_RANK_STATS=str(tmp_path / f"ranks{n}"))
        assert_ok(run_cli(["train", str(write_config(tmp_path / f"n{n}.yaml", cfg))], nproc=n, env=env, timeout=400))
        runs[n] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["grad_norm"] > 0 and a["value_loss"] > 0
        for key in ("loss", "grad_norm", "value_loss", "kl", "entropy", "clip_fraction", "reward_advantage_std_raw"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        for key in ("reward_mean", "reward_std", "agent/turns", "agent/tool_calls", "agent/tool_valid",
                    "completion_length", "agent/env_token_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
        assert (a["reward_mean"], a["agent/turns"], a["agent/tool_valid"]) == (0.5, 1.5, 1.0)
    assert one[0]["kl"] == 0.0 and one[1]["kl"] != 0.0  # k1 (may be < 0): the second rollout's policy has moved
    for folder in ("final", "final_value"):
        wa, wb = (load_file(str(tmp_path / f"n{n}" / folder / "model.safetensors")) for n in (1, 2))
        assert max_delta(wa, wb) <= 1e-5, folder
    single = json.loads((tmp_path / "ranks1" / "rank_0.json").read_text())
    r0, r1 = (json.loads((tmp_path / "ranks2" / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert len(single) == len(r0) == 2 and r0 == r1  # identical on every rank, to the last bit
    for s, r in zip(single, r0):
        assert s.keys() == r.keys() and "kl" in s and "reward_advantage_std_raw" in s
        for key in s:
            assert s[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
