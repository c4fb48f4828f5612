"""What ``rollout.placement: separate``'s generator processes do besides sampling (issue 47 item 1, issue 48 item 3),
1 trainer + 1 generator process on gloo against 1 colocated process, k = 0:

* the generators run the reward functions: a function that records the process calling it is called by the
  generator alone (never by the trainer), and the run's numbers equal the colocated run's exactly;
* ``grpo_agent``: the generators run the environment and the multi-turn loop and send the finished trajectories;
  the scripted agent engine (tests/plugins/scripted_agent_engine.py: half of each group calls the calculator then
  answers right, half guesses wrong) gives nonzero advantages, and every logged loss, gradient norm, reward and
  agent metric, and the final weights, equal the colocated run's exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, child_env, run_cli, write_config
from tests.distributed.runs import final_weights, max_delta

pytestmark = pytest.mark.distributed


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow(seconds=60)
def test_generators_run_the_reward_functions(micro_model: Path, tmp_path: Path) -> None:
    from alignkit.data.synth import make_prompt_rows, write_rows

    prompts = tmp_path / "prompts.jsonl"
    write_rows(make_prompt_rows(40, seed=0), prompts)
    cfg = {"algorithm": "grpo", "model": {"name_or_path": str(micro_model)},
           "data": {"train": str(prompts), "max_length": 48},
           "rollout": {"num_generations": 4, "max_new_tokens": 6},
           "training": {"per_device_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 1.0e-3,
                        "max_steps": 2, "seed": 0},
           "logging": {"report_to": ["jsonl"], "logging_steps": 1, "plot": False},
           "checkpoint": {"save_steps": 2},
           "reward": {"functions": [{"name": "length", "weight": 0.1},
                                    {"name": "tests.plugins.recording_reward:characters", "weight": 0.01}]}}
    calls = {}
    for name, extra, nproc in (("colocated", [], 1), ("separate", ["rollout.placement=separate"], 2)):
        calls[name] = tmp_path / f"{name}.calls"
        env = child_env(ALIGNKIT_TEST_REWARD_LOG=str(calls[name]))
        path = write_config(tmp_path / f"{name}.yaml", {**cfg, "output_dir": str(tmp_path / name)})
        assert_ok(run_cli(["train", str(path), "distributed.strategy=single", *extra], nproc=nproc, env=env,
                          timeout=300))
    recorded = {k: [json.loads(line) for line in v.read_text().splitlines()] for k, v in calls.items()}
    assert recorded["colocated"] == [{"rank": 0, "n": 8}] * 2
    assert recorded["separate"] == [{"rank": 1, "n": 8}] * 2  # the generator (rank 1), once per iteration
    colocated, separate = _rows(tmp_path / "colocated"), _rows(tmp_path / "separate")
    assert len(colocated) == len(separate) == 2
    for a, b in zip(colocated, separate):
        for key in ("loss", "reward_mean", "reward/length", "grad_norm", "advantage_std"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["reward/tests.plugins.recording_reward:characters"] > 0
    assert max_delta(final_weights(tmp_path / "colocated"), final_weights(tmp_path / "separate")) == 0.0


@pytest.mark.slow(seconds=60)
def test_agent_trajectories_made_on_the_generator(micro_model: Path, tmp_path: Path) -> None:
    from tests.integration.test_agent_cli import config  # the scripted agent run of the resume test, 4 iterations

    for name, extra, nproc in (("colocated", [], 1), ("separate", ["rollout.placement=separate"], 2)):
        assert_ok(run_cli(["train", str(config(micro_model, tmp_path / name)), *extra], nproc=nproc, timeout=300))
    colocated, separate = _rows(tmp_path / "colocated"), _rows(tmp_path / "separate")
    assert len(colocated) == len(separate) == 4
    for a, b in zip(colocated, separate):
        assert a["loss"] != 0.0 and a["grad_norm"] > 0
        for key in ("loss", "grad_norm", "reward_mean", "advantage_std", "agent/turns", "agent/tool_calls",
                    "agent/tool_valid", "agent/truncated", "completion_length", "agent/env_token_fraction"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert (b["reward_mean"], b["agent/turns"]) == (0.5, 1.5)  # the script's: half call then answer right
        assert b["staleness/0"] == 8 and b["staleness/dropped"] == 0
        assert b["agent/env_time_share"] > 0  # the generator's environment seconds
    assert max_delta(final_weights(tmp_path / "colocated"), final_weights(tmp_path / "separate")) == 0.0


@pytest.mark.slow(seconds=60)
def test_ppo_agent_trajectories_made_on_the_generator(micro_model: Path, tmp_path: Path) -> None:
    """``ppo_agent`` split as grpo_agent's (issue 48): the generator runs the environments, the critic stays on the
    trainer (values of the received ids); every logged number and the final policy and value weights equal the
    colocated run's exactly."""
    from tests.integration.test_agent_cli import ppo_config

    for name, extra, nproc in (("colocated", [], 1), ("separate", ["rollout.placement=separate"], 2)):
        cfg = {**ppo_config(micro_model, tmp_path / name), "checkpoint": {"save_final": True}}
        assert_ok(run_cli(["train", str(write_config(tmp_path / f"{name}.yaml", cfg)), *extra], nproc=nproc,
                          timeout=300))
    colocated, separate = _rows(tmp_path / "colocated"), _rows(tmp_path / "separate")
    assert len(colocated) == len(separate) == 2
    for a, b in zip(colocated, separate):
        assert a["grad_norm"] > 0 and a["value_loss"] > 0  # the policy loss of whitened advantages is ~0
        for key in ("loss", "grad_norm", "value_loss", "kl", "clip_fraction", "reward_mean", "reward_std",
                    "reward_advantage_std_raw", "agent/turns", "agent/tool_calls", "agent/tool_valid",
                    "completion_length", "agent/env_token_fraction"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert (b["reward_mean"], b["agent/turns"]) == (0.5, 1.5)
        assert b["staleness/0"] == 4 and b["agent/env_time_share"] > 0
    for folder in ("final", "final_value"):  # the policy and the critic
        a, b = (load_file(str(tmp_path / run / folder / "model.safetensors")) for run in ("colocated", "separate"))
        assert max_delta(a, b) == 0.0, folder
